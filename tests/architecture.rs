//! The crate's layering, checked from its source (docs/architecture.md
//! explains it): modules import only modules below them, so there is no
//! circle; and the layers above the backend boundary never touch host
//! slices of tensors, so the same code runs on every device.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Rank of each top-level module: a module may import only modules of a
/// lower rank. A new module must be placed here.
const RANKS: &[(&str, u32)] = &[
    ("accounting", 0),
    ("device", 0),
    ("profile", 0),
    ("error", 1),
    ("dist", 2),
    ("tensor", 2),
    ("baseline", 2),
    ("data", 3),
    ("memory", 3),
    ("ops", 3),
    ("backend", 4),
    ("nn", 5),
    ("exec", 6),
    ("optim", 6),
    ("io", 6),
    ("plan", 7),
    ("train", 8),
    ("setup", 9),
    ("bench", 10),
    ("run", 10),
];

/// Names the crate root re-exports, and the module they come from.
const ROOT_REEXPORTS: &[(&str, &str)] = &[("Error", "error"), ("Result", "error")];

/// Modules above the backend boundary: no host slices outside tests.
const ABOVE_BOUNDARY: &[&str] = &["nn", "exec", "optim", "plan", "train"];

/// The host-slice views of a tensor.
const HOST_VIEWS: &[&str] = &[
    ".f32()",
    ".f32_mut()",
    ".bf16()",
    ".bf16_mut()",
    ".f16()",
    ".f16_mut()",
    ".bits()",
    ".bits_mut()",
];

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file without comment lines and without its trailing
/// `#[cfg(test)]` module (tests may reach anything).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let body = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => &text,
    };
    body.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules a piece of code names as `crate::name`.
fn crate_refs(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        match ROOT_REEXPORTS.iter().find(|(n, _)| *n == name) {
            Some((_, module)) => out.push(module.to_string()),
            None => out.push(name),
        }
    }
    out
}

/// Every library source file by its top-level module.
fn modules() -> BTreeMap<String, Vec<PathBuf>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().to_string();
        if name == "lib" || name == "bin" {
            continue;
        }
        let mut files = Vec::new();
        if p.is_dir() {
            rs_files(&p, &mut files);
        } else {
            files.push(p);
        }
        out.insert(name, files);
    }
    out
}

#[test]
fn modules_import_only_modules_below_them() {
    let rank: BTreeMap<&str, u32> = RANKS.iter().copied().collect();
    let mut bad = Vec::new();
    for (module, files) in modules() {
        let Some(&r) = rank.get(module.as_str()) else {
            bad.push(format!("src/{module}: not placed in RANKS"));
            continue;
        };
        for f in files {
            for used in crate_refs(&code(&f)) {
                if used == module {
                    continue;
                }
                match rank.get(used.as_str()) {
                    Some(&u) if u < r => {}
                    _ => bad.push(format!("{}: {module} imports {used}", f.display())),
                }
            }
        }
    }
    bad.sort();
    bad.dedup();
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn layers_above_the_backend_never_touch_host_slices() {
    let mut bad = Vec::new();
    for (module, files) in modules() {
        if !ABOVE_BOUNDARY.contains(&module.as_str()) {
            continue;
        }
        for f in files {
            for line in code(&f).lines() {
                if HOST_VIEWS.iter().any(|v| line.contains(v)) {
                    bad.push(format!("{}: {}", f.display(), line.trim()));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "host slices above the backend boundary (use crate::backend):\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_checks_see_what_they_check() {
    // The scanners find what they look for, so an empty result means
    // something: the backend does read host slices, and nn names backend.
    let m = modules();
    let backend = m["backend"].iter().map(|f| code(f)).collect::<String>();
    assert!(HOST_VIEWS.iter().any(|v| backend.contains(v)));
    let nn = m["nn"].iter().map(|f| code(f)).collect::<String>();
    assert!(crate_refs(&nn).iter().any(|r| r == "backend"));
}

/// `bench step --profile` on a GPU shows the host time per op family, so
/// every CUDA arm of the backend boundary runs inside a timed region
/// (`host_timed` / `profile::timed`); a new op added without one would be
/// missing from the table and counted as waiting on the device. The arms
/// left out are listed with why.
#[test]
fn every_cuda_arm_of_the_boundary_is_timed_for_the_profile() {
    const UNTIMED: &[(&str, &str)] = &[
        (
            "conv2d_backward",
            "its dgrad and wgrad halves are timed in backend/cuda/ops.rs",
        ),
        (
            "all_reduce_sum",
            "the collective: timed by the data-parallel step itself",
        ),
        (
            "synchronize",
            "the wait at the end of a step, which the rest of the table is",
        ),
    ];
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend");
    let mut arms = 0;
    let mut untimed = Vec::new();
    for file in ["mod.rs", "totals.rs"] {
        let src = code(&root.join(file));
        for (at, _) in src.match_indices("Device::Cuda(") {
            let before = &src[..at];
            let func = before
                .rfind("fn ")
                .map(|i| {
                    let rest = &before[i + 3..];
                    &rest[..rest.find(['(', '<']).unwrap_or(rest.len())]
                })
                .unwrap_or("?");
            if UNTIMED.iter().any(|(f, _)| *f == func) {
                continue;
            }
            arms += 1;
            let arm = &src[at..];
            let end = arm[1..].find("Device::").map_or(arm.len(), |i| i + 1);
            if !arm[..end].contains("timed(") {
                untimed.push(format!("{file}: {func}"));
            }
        }
    }
    assert!(
        untimed.is_empty(),
        "CUDA arms outside a timed region: {untimed:?}"
    );
    // The scan saw the boundary (about 30 ops).
    assert!(arms >= 30, "only {arms} CUDA arms found");
}
