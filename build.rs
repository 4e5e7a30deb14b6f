//! Puts the git commit memfit is built from into `memfit --version`
//! (`MEMFIT_VERSION`): "0.1.0 (3fb7266)", with "-dirty" when tracked files
//! under this package differ from the commit, and "0.1.0" alone outside its
//! own git checkout (a crate tarball, a copy inside another repository) or
//! without git.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        // Never take the index lock (a concurrent git command would fail,
        // and a rewritten index would make cargo run this again).
        .arg("--no-optional-locks")
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into()));
    let version = env!("CARGO_PKG_VERSION");
    // Asked again when the sources change (the dirty mark) or git's HEAD,
    // branch ref or index does; a rebuild follows only when the string
    // changes. Only paths that exist: cargo reruns a script every build
    // for a missing one.
    for path in ["build.rs", "src", "Cargo.toml", "Cargo.lock"] {
        if dir.join(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let own_checkout = git(&dir, &["rev-parse", "--show-toplevel"])
        .and_then(|top| std::fs::canonicalize(top).ok())
        .zip(std::fs::canonicalize(&dir).ok())
        .is_some_and(|(top, here)| top == here);
    if !own_checkout {
        println!("cargo:rustc-env=MEMFIT_VERSION={version}");
        return;
    }
    let mut watched = vec![
        "HEAD".to_owned(),
        "index".to_owned(),
        "packed-refs".to_owned(),
    ];
    if let Some(head) = git(&dir, &["symbolic-ref", "-q", "HEAD"]) {
        watched.push(head);
    }
    for name in watched {
        if let Some(path) = git(
            &dir,
            &["rev-parse", "--path-format=absolute", "--git-path", &name],
        ) && Path::new(&path).exists()
        {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let full = match git(&dir, &["rev-parse", "--short=7", "HEAD"]) {
        Some(commit) if !commit.is_empty() => {
            let dirty = git(
                &dir,
                &["status", "--porcelain", "--untracked-files=no", "--", "."],
            )
            .is_some_and(|s| !s.is_empty());
            format!("{version} ({commit}{})", if dirty { "-dirty" } else { "" })
        }
        _ => version.to_owned(),
    };
    println!("cargo:rustc-env=MEMFIT_VERSION={full}");
}
