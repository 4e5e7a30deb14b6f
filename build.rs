//! Puts the git commit memfit is built from into `memfit --version`
//! (`MEMFIT_VERSION`): "0.1.0 (3fb7266)", with "-dirty" when tracked files
//! had uncommitted changes at build time, and "0.1.0" alone outside a git
//! checkout (a crate tarball) or without git.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn main() {
    // Asked again when HEAD moves (a commit, a checkout) or the index
    // changes; a rebuild follows only when the string changes.
    for path in [".git/HEAD", ".git/index"] {
        println!("cargo:rerun-if-changed={path}");
    }
    if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
        println!("cargo:rerun-if-changed=.git/{head}");
    }
    let version = env!("CARGO_PKG_VERSION");
    let full = match git(&["rev-parse", "--short=7", "HEAD"]) {
        Some(commit) if !commit.is_empty() => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            format!("{version} ({commit}{})", if dirty { "-dirty" } else { "" })
        }
        _ => version.to_owned(),
    };
    println!("cargo:rustc-env=MEMFIT_VERSION={full}");
}
