//! Every CUDA kernel source compiles to PTX with NVRTC, for the oldest
//! architecture CUDA 13 supports (Turing, `compute_75`) and for Hopper
//! (`compute_90`), and exports every `extern "C"` kernel it declares. Runs on
//! machines without a GPU: NVRTC alone is enough (CI installs it from PyPI).
//!
//! Without NVRTC the tests print why and pass, unless
//! `MEMFIT_REQUIRE_NVRTC=1` (CI sets it), where they fail.

#![cfg(any(feature = "cuda", feature = "cuda-12"))]

use std::time::Instant;

use memfit::Error;
use memfit::backend::cuda::{CI_ARCHS, KERNEL_SOURCES, compile, kernel_names};
use memfit::device::cuda::Library;

#[cfg(not(feature = "cuda-12"))]
const SKIP: &str = "skipped: NVRTC not found (pip install \"nvidia-cuda-nvrtc>=13,<14\" and put \
                    site-packages/nvidia/cu13/lib on LD_LIBRARY_PATH)";
#[cfg(feature = "cuda-12")]
const SKIP: &str = "skipped: NVRTC not found (pip install \"nvidia-cuda-nvrtc-cu12>=12.8,<12.9\" \
                    and put site-packages/nvidia/cuda_nvrtc/lib on LD_LIBRARY_PATH)";

/// Whether NVRTC can be loaded; if not, says so and passes, or fails when
/// `MEMFIT_REQUIRE_NVRTC=1`.
fn nvrtc_or_skip() -> bool {
    if Library::Nvrtc.is_present() {
        return true;
    }
    if std::env::var("MEMFIT_REQUIRE_NVRTC").as_deref() == Ok("1") {
        panic!("MEMFIT_REQUIRE_NVRTC=1 but {}", Library::Nvrtc.missing());
    }
    println!("{SKIP}");
    false
}

#[test]
fn every_kernel_source_compiles_for_every_ci_arch() {
    if !nvrtc_or_skip() {
        return;
    }
    let mut failures = Vec::new();
    for &arch in CI_ARCHS {
        for &(name, source) in KERNEL_SOURCES {
            let t = Instant::now();
            match compile(name, source, arch) {
                Ok(ptx) => {
                    let text = ptx.to_src();
                    let kernels = kernel_names(source);
                    assert!(!kernels.is_empty(), "{name}: no extern \"C\" kernels found");
                    for k in &kernels {
                        // A PTX entry point is `.visible .entry name(`.
                        assert!(
                            text.contains(&format!(".entry {k}(")),
                            "{name} for {arch}: kernel {k} missing from the PTX"
                        );
                    }
                    println!(
                        "{name:>10} {arch}: {} kernels, {} bytes of PTX, {:.2} s",
                        kernels.len(),
                        text.len(),
                        t.elapsed().as_secs_f64()
                    );
                }
                Err(e) => failures.push(format!("{e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn a_broken_kernel_fails_with_nvrtcs_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let broken = "#line 1 \"broken.cu\"\n\
                  extern \"C\" __global__ void broken(float* y) { y[0] = undeclared_name; }\n";
    match compile("broken", broken, "compute_75") {
        Err(Error::KernelCompile { kernel, arch, log }) => {
            assert_eq!(kernel, "broken");
            assert_eq!(arch, "compute_75");
            assert!(log.contains("undeclared_name"), "log: {log}");
            assert!(log.contains("broken.cu"), "log names the file: {log}");
        }
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("a broken kernel compiled"),
    }
}

#[test]
fn kernel_names_lists_the_extern_c_kernels() {
    let src = "extern \"C\" __global__ void a(float* x) {}\n\
               __device__ float helper(float v) { return v; }\n\
               extern \"C\" __global__ void b_2(int n) {}\n";
    assert_eq!(kernel_names(src), ["a", "b_2"]);
    for &(name, source) in KERNEL_SOURCES {
        let names = kernel_names(source);
        assert!(!names.is_empty(), "{name}");
        assert!(
            source.starts_with(&format!("#line 1 \"{name}.cu\"")),
            "{name}.cu must start with its #line directive"
        );
    }
}

#[test]
fn the_numerics_policy_reaches_the_ptx() {
    // Compiled with --fmad=false, no f32 `a * b + c` becomes one fused
    // multiply-add: each rounds twice, as in Rust, which is what lets the
    // elementwise kernels give the CPU's bits; and f32 subnormals are kept
    // (--ftz=false). (The f64 exp/log that the loss calls use fma.rn.f64 and
    // an rcp.approx.ftz.f64 seed inside: the math library's own code.)
    if !nvrtc_or_skip() {
        return;
    }
    for &(name, source) in KERNEL_SOURCES {
        let text = compile(name, source, "compute_90").unwrap().to_src();
        assert!(text.contains(".target sm_90"), "{name}: target");
        assert!(!text.contains("fma.rn.f32"), "{name}: contracted f32 fma");
        assert!(!text.contains(".ftz.f32"), "{name}: f32 flush to zero");
    }
}

// ---------------------------------------------------------------------------
// Launch arguments against the kernels' parameter lists (no NVRTC, no GPU)

/// The kind of one kernel argument: what ops.rs's `Arg` passes and what a
/// kernel's C parameter declares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Ptr,
    I64,
    I32,
    F32,
}

impl Kind {
    fn c_name(self) -> &'static str {
        match self {
            Kind::Ptr => "pointer",
            Kind::I64 => "long long",
            Kind::I32 => "int",
            Kind::F32 => "float",
        }
    }
}

/// The `Arg` variants of ops.rs and the kinds they pass.
const ARG_VARIANTS: [(&str, Kind); 4] = [
    ("Arg::Ptr", Kind::Ptr),
    ("Arg::I64", Kind::I64),
    ("Arg::I32", Kind::I32),
    ("Arg::F32", Kind::F32),
];

fn is_ident_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

fn is_ident(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(is_ident_byte) && !s.as_bytes()[0].is_ascii_digit()
}

/// The index after the string or char literal starting at `b[i]`, or None
/// when none starts there (a Rust lifetime `'a` is not one).
fn literal_end(b: &[u8], i: usize) -> Option<usize> {
    match b[i] {
        b'"' => {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            Some((j + 1).min(b.len()))
        }
        b'\'' if b.get(i + 2) == Some(&b'\'') => Some(i + 3),
        b'\'' if b.get(i + 1) == Some(&b'\\') => b[i + 2..]
            .iter()
            .position(|&c| c == b'\'')
            .map(|p| i + 3 + p),
        _ => None,
    }
}

/// `src` with its `//` and `/* */` comments blanked to spaces (newlines
/// kept, so byte offsets and line numbers still match).
fn blank_comments(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = b.to_vec();
    let mut i = 0;
    while i < b.len() {
        if let Some(end) = literal_end(b, i) {
            i = end;
            continue;
        }
        let end = match (b[i], b.get(i + 1)) {
            (b'/', Some(b'/')) => src[i..].find('\n').map_or(b.len(), |e| i + e),
            (b'/', Some(b'*')) => src[i + 2..].find("*/").map_or(b.len(), |e| i + e + 4),
            _ => {
                i += 1;
                continue;
            }
        };
        for c in &mut out[i..end] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
        i = end;
    }
    String::from_utf8(out).expect("blanking whole comments keeps UTF-8")
}

/// Calls `f(index, byte, depth)` for each byte of `s` outside literals, in
/// order, with the bracket depth around it (a bracket gets the depth outside
/// it), until `f` returns true; returns that index.
fn walk(s: &str, mut f: impl FnMut(usize, u8, i32) -> bool) -> Option<usize> {
    let b = s.as_bytes();
    let (mut i, mut depth) = (0, 0);
    while i < b.len() {
        if let Some(end) = literal_end(b, i) {
            i = end;
            continue;
        }
        let c = b[i];
        if matches!(c, b')' | b']' | b'}') {
            depth -= 1;
        }
        if f(i, c, depth) {
            return Some(i);
        }
        if matches!(c, b'(' | b'[' | b'{') {
            depth += 1;
        }
        i += 1;
    }
    None
}

/// The index of the bracket closing the one at `s[open]`.
fn closing(s: &str, open: usize) -> Option<usize> {
    walk(&s[open..], |i, c, d| {
        i > 0 && d == 0 && matches!(c, b')' | b']' | b'}')
    })
    .map(|i| open + i)
}

/// The index of the `;` ending the statement `s` starts.
fn statement_end(s: &str) -> Option<usize> {
    walk(s, |_, c, d| c == b';' && d == 0)
}

/// `s` split at its commas outside brackets and literals, trimmed, empty
/// pieces (a trailing comma) dropped.
fn split_top(s: &str) -> Vec<&str> {
    let mut cuts = Vec::new();
    walk(s, |i, c, d| {
        if c == b',' && d == 0 {
            cuts.push(i);
        }
        false
    });
    let mut parts = Vec::new();
    let mut start = 0;
    for cut in cuts.into_iter().chain([s.len()]) {
        parts.push(s[start..cut].trim());
        start = cut + 1;
    }
    parts.retain(|p| !p.is_empty());
    parts
}

/// The contents of the string literal `e`, if it is one.
fn string_literal(e: &str) -> Option<&str> {
    let inner = e.trim().strip_prefix('"')?.strip_suffix('"')?;
    (!inner.contains('"')).then_some(inner)
}

/// `e` on one line, cut short, for messages.
fn short(e: &str) -> String {
    let one = e.split_whitespace().collect::<Vec<_>>().join(" ");
    if one.chars().count() > 60 {
        format!("{}...", one.chars().take(60).collect::<String>())
    } else {
        one
    }
}

/// A kernel's parameters: each declaration and its kind (None: a C type
/// no `Arg` passes).
type Params = Vec<(String, Option<Kind>)>;

/// Each `extern "C"` kernel of a .cu source: its name and [`Params`].
fn kernel_signatures(source: &str) -> Vec<(String, Params)> {
    let src = blank_comments(source);
    let head = "extern \"C\" __global__ void ";
    let mut kernels = Vec::new();
    for (at, _) in src.match_indices(head) {
        let rest = &src[at + head.len()..];
        let open = rest.find('(').expect("a kernel's parameter list");
        let close = closing(rest, open).expect("a kernel's parameter list closes");
        let params = split_top(&rest[open + 1..close])
            .into_iter()
            .filter(|p| *p != "void")
            .map(|p| (short(p), param_kind(p)))
            .collect();
        kernels.push((rest[..open].trim().to_owned(), params));
    }
    kernels
}

/// The kind of a C parameter declaration: any pointer (`const`,
/// `__restrict__` and the pointee type aside), `long long`, `int`, `float`.
fn param_kind(decl: &str) -> Option<Kind> {
    if decl.contains('*') || decl.contains('[') {
        return Some(Kind::Ptr);
    }
    let words: Vec<&str> = decl
        .split_whitespace()
        .filter(|w| !matches!(*w, "const" | "__restrict__" | "volatile"))
        .collect();
    match words[..words.len().saturating_sub(1)].join(" ").as_str() {
        "long long" | "long long int" => Some(Kind::I64),
        "int" => Some(Kind::I32),
        "float" => Some(Kind::F32),
        _ => None,
    }
}

/// The functions of ops.rs that return one `Arg` (`-> Arg` or
/// `-> Result<Arg>`: `ptr`, `n64`, `i32_arg`, ...), each with the kind of
/// the one `Arg` variant its body makes.
fn arg_helpers(ops: &str) -> Vec<(String, Kind)> {
    let mut helpers = Vec::new();
    for (at, _) in ops.match_indices("fn ") {
        if at > 0 && is_ident_byte(ops.as_bytes()[at - 1]) {
            continue;
        }
        let rest = &ops[at + 3..];
        let Some(open) = rest.find('(') else { continue };
        let Some(close) = closing(rest, open) else {
            continue;
        };
        let Some(body_open) = rest[close..].find('{').map(|b| close + b) else {
            continue;
        };
        let ret = rest[close + 1..body_open].trim();
        if !matches!(ret, "-> Arg" | "-> Result<Arg>") {
            continue;
        }
        let Some(body_close) = closing(rest, body_open) else {
            continue;
        };
        let body = &rest[body_open..body_close];
        let kinds: Vec<Kind> = ARG_VARIANTS
            .iter()
            .filter(|(v, _)| body.contains(v))
            .map(|&(_, k)| k)
            .collect();
        if let [kind] = kinds[..] {
            helpers.push((rest[..open].trim().to_owned(), kind));
        }
    }
    helpers
}

/// The kind of one launch argument expression: `Arg::X(..)` or a call of a
/// helper of [`arg_helpers`].
fn arg_kind(e: &str, helpers: &[(String, Kind)]) -> Option<Kind> {
    let head = e.trim().split('(').next()?.trim();
    ARG_VARIANTS
        .iter()
        .find(|(v, _)| *v == head)
        .map(|&(_, k)| k)
        .or_else(|| helpers.iter().find(|(h, _)| h == head).map(|&(_, k)| k))
}

/// One launch resolved: its kernel names and the argument lists it may pass
/// (each name is launched with one of them).
struct Group {
    names: Vec<String>,
    lists: Vec<Vec<String>>,
}

/// The index just past the last `let var = ` or `let mut var = ` in `body`.
fn last_let(body: &str, var: &str) -> Option<usize> {
    [format!("let {var} = "), format!("let mut {var} = ")]
        .iter()
        .filter_map(|pat| body.rfind(pat.as_str()).map(|at| at + pat.len()))
        .max()
}

/// The strings the binding `var` (its last `let` in `body`) can hold: a
/// literal, or the literals that are whole arms of a `match` or branches
/// of an `if` (right after `=>` or `{`, right before `,` or `}`).
fn binding_values(body: &str, var: &str) -> Result<Vec<String>, String> {
    let at = last_let(body, var).ok_or(format!("no `let {var} = ` before the launch"))?;
    let end = statement_end(&body[at..]).ok_or(format!("`let {var}` does not end"))?;
    let rhs = body[at..at + end].trim();
    if let Some(lit) = string_literal(rhs) {
        return Ok(vec![lit.to_owned()]);
    }
    let b = rhs.as_bytes();
    let mut values = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match literal_end(b, i) {
            Some(end) if b[i] == b'"' => {
                let before = rhs[..i].trim_end();
                let after = rhs[end..].trim_start();
                if (before.ends_with("=>") || before.ends_with('{'))
                    && (after.starts_with(',') || after.starts_with('}'))
                    && !values.iter().any(|v| *v == rhs[i + 1..end - 1])
                {
                    values.push(rhs[i + 1..end - 1].to_owned());
                }
                i = end;
            }
            Some(end) => i = end,
            None => i += 1,
        }
    }
    if values.is_empty() {
        return Err(format!(
            "`let {var} = {}` gives no literal kernel name",
            short(rhs)
        ));
    }
    Ok(values)
}

/// The kernel names `expr` (a launch's name argument) can be: a literal, a
/// binding of [`binding_values`], or `format!` of a literal with one
/// `{binding}` in it.
fn resolve_names(body: &str, expr: &str) -> Result<Vec<String>, String> {
    let expr = expr.trim().trim_start_matches('&');
    if let Some(lit) = string_literal(expr).filter(|l| !l.contains('{')) {
        return Ok(vec![lit.to_owned()]);
    }
    if is_ident(expr) {
        return binding_values(body, expr);
    }
    let unknown = || {
        format!(
            "kernel name `{}` is not a form this test resolves",
            short(expr)
        )
    };
    let inner = expr
        .strip_prefix("format!(")
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(unknown)?;
    let [fmt] = split_top(inner)[..] else {
        return Err(unknown());
    };
    let fmt = string_literal(fmt).ok_or_else(unknown)?;
    let (head, rest) = fmt.split_once('{').ok_or_else(unknown)?;
    let (var, tail) = rest.split_once('}').ok_or_else(unknown)?;
    if !is_ident(var) || tail.contains('{') {
        return Err(unknown());
    }
    Ok(binding_values(body, var)?
        .into_iter()
        .map(|v| format!("{head}{v}{tail}"))
        .collect())
}

/// The elements of `[a, b]` or `vec![a, b]` (perhaps behind `&`).
fn list_items(expr: &str) -> Result<Vec<String>, String> {
    let e = expr.trim().trim_start_matches('&');
    let e = e.strip_prefix("vec!").unwrap_or(e);
    if e.starts_with('[') && closing(e, 0) == Some(e.len() - 1) {
        return Ok(split_top(&e[1..e.len() - 1])
            .into_iter()
            .map(str::to_owned)
            .collect());
    }
    Err(format!("`{}` is not an array or vec! literal", short(expr)))
}

/// What `var.extend(e)` adds: a list literal, or a call of an ops.rs
/// function whose body builds its one `vec![..]` (`pool_args`).
fn extension_items(ops: &str, e: &str) -> Result<Vec<String>, String> {
    if let Ok(items) = list_items(e) {
        return Ok(items);
    }
    let name = e.split('(').next().unwrap_or("").trim();
    let unknown = || format!("cannot see what `extend({})` adds", short(e));
    if !is_ident(name) {
        return Err(unknown());
    }
    let at = ops.find(&format!("fn {name}(")).ok_or_else(unknown)?;
    let open = at + ops[at..].find('{').ok_or_else(unknown)?;
    let body = &ops[open..closing(ops, open).ok_or_else(unknown)?];
    let vecs: Vec<usize> = body.match_indices("vec![").map(|(i, _)| i).collect();
    let [v] = vecs[..] else {
        return Err(unknown());
    };
    let close = closing(body, v + 4).ok_or_else(unknown)?;
    list_items(&body[v..=close])
}

/// The argument lists `var` can hold at the launch: `items`, then each
/// `var.push(x)` / `var.extend(..)` of `after` (the text from its `let` to
/// the launch) applied; one inside a block (an `if`) may not have run, so
/// it keeps the lists without it too.
fn mutate(
    ops: &str,
    items: Vec<String>,
    after: &str,
    var: &str,
) -> Result<Vec<Vec<String>>, String> {
    let dot = format!("{var}.");
    let mut uses = Vec::new();
    walk(after, |i, _, d| {
        let b = after.as_bytes();
        if b[i..].starts_with(dot.as_bytes()) && (i == 0 || !is_ident_byte(b[i - 1])) {
            uses.push((i, d));
        }
        false
    });
    let mut lists = vec![items];
    for (i, depth) in uses {
        let rest = &after[i + dot.len()..];
        let open = rest.find('(').ok_or(format!("`{var}.` without a call"))?;
        let close = closing(rest, open).ok_or(format!("`{var}.` call does not close"))?;
        let inner = &rest[open + 1..close];
        let added = match &rest[..open] {
            "push" => vec![inner.trim().to_owned()],
            "extend" => extension_items(ops, inner)?,
            other => return Err(format!("`{var}.{other}(..)` is not push or extend")),
        };
        let grown: Vec<Vec<String>> = lists
            .iter()
            .map(|l| l.iter().chain(&added).cloned().collect())
            .collect();
        if depth > 0 {
            lists.extend(grown);
        } else {
            lists = grown;
        }
    }
    Ok(lists)
}

/// The argument lists `expr` (a launch's args argument) can be: a list
/// literal, or `&var` with its `let var = [..]` / `vec![..]` in `body` and
/// what [`mutate`] adds.
fn resolve_args(ops: &str, body: &str, expr: &str) -> Result<Vec<Vec<String>>, String> {
    let Some(var) = expr.trim().strip_prefix('&').filter(|v| is_ident(v)) else {
        return Ok(vec![list_items(expr)?]);
    };
    let at = last_let(body, var).ok_or(format!("no `let {var} = ` before the launch"))?;
    let end = at + statement_end(&body[at..]).ok_or(format!("`let {var}` does not end"))?;
    mutate(ops, list_items(&body[at..end])?, &body[end..], var)
}

/// A launch's kernel names and argument lists; `body` is its function's
/// text up to the launch. Besides [`resolve_names`] × [`resolve_args`],
/// reads `let (name, mut args) = if .. { ("a", vec![..]) } else { ("b",
/// vec![..]) };` as pairs.
fn resolve(ops: &str, body: &str, name: &str, args: &str) -> Result<Vec<Group>, String> {
    let args_var = args.trim().strip_prefix('&').filter(|v| is_ident(v));
    if let (true, Some(a)) = (is_ident(name.trim()), args_var) {
        let n = name.trim();
        let pats = [
            format!("let ({n}, mut {a}) = "),
            format!("let ({n}, {a}) = "),
        ];
        if let Some(at) = pats
            .iter()
            .filter_map(|p| body.rfind(p.as_str()).map(|at| at + p.len()))
            .max()
        {
            let end = at + statement_end(&body[at..]).ok_or("the tuple `let` does not end")?;
            let rhs = &body[at..end];
            let mut groups = Vec::new();
            for (i, _) in rhs.match_indices("(\"") {
                if !rhs[..i].trim_end().ends_with('{') {
                    continue;
                }
                let close = closing(rhs, i).ok_or("a tuple does not close")?;
                let [lit, list] = split_top(&rhs[i + 1..close])[..] else {
                    return Err(format!("`{}` is not (name, args)", short(&rhs[i..=close])));
                };
                let lit = string_literal(lit).ok_or(format!("`{lit}` is not a literal"))?;
                groups.push(Group {
                    names: vec![lit.to_owned()],
                    lists: mutate(ops, list_items(list)?, &body[end..], a)?,
                });
            }
            if groups.is_empty() {
                return Err(format!("no (\"name\", args) in `{}`", short(rhs)));
            }
            return Ok(groups);
        }
    }
    Ok(vec![Group {
        names: resolve_names(body, name)?,
        lists: resolve_args(ops, body, args)?,
    }])
}

/// Why `list` does not fit `params`, or None when it does.
fn mismatch(
    list: &[String],
    params: &[(String, Option<Kind>)],
    helpers: &[(String, Kind)],
) -> Option<String> {
    let mut why = Vec::new();
    if list.len() != params.len() {
        why.push(format!(
            "{} arguments passed, the kernel takes {}",
            list.len(),
            params.len()
        ));
    }
    for (i, (arg, (decl, want))) in list.iter().zip(params).enumerate() {
        let at = format!("argument {} of {} (`{}`)", i + 1, list.len(), short(arg));
        match (want, arg_kind(arg, helpers)) {
            (_, None) => why.push(format!(
                "{at}: not an `Arg::*(..)` or a helper returning one Arg"
            )),
            (None, _) => why.push(format!(
                "{at}: the kernel's `{decl}` has a C type no Arg passes"
            )),
            (Some(w), Some(f)) if *w != f => why.push(format!(
                "{at}: expected {} (`{decl}`), found {}",
                w.c_name(),
                f.c_name()
            )),
            _ => {}
        }
    }
    (!why.is_empty()).then(|| why.join("; "))
}

/// What [`check_launches`] found.
#[derive(Default)]
struct LaunchReport {
    /// Launch calls resolved and checked.
    sites: usize,
    /// `ops.rs:LINE module::kernel`, one per kernel a launch may start.
    checked: Vec<String>,
    /// `ops.rs:LINE: why`, launches not resolved.
    skipped: Vec<String>,
    failures: Vec<String>,
}

/// Checks every `launch(..)` / `launch_shape(..)` call of `ops` (the text
/// of ops.rs) against the kernels of `sources` ((module, .cu text)): the
/// number of arguments and each one's kind, in order.
fn check_launches(ops_src: &str, sources: &[(&str, &str)]) -> LaunchReport {
    let ops = blank_comments(ops_src);
    let ops = ops.as_str();
    let kernels: Vec<(&str, String, Params)> = sources
        .iter()
        .flat_map(|&(m, src)| {
            kernel_signatures(src)
                .into_iter()
                .map(move |(k, params)| (m, k, params))
        })
        .collect();
    let helpers = arg_helpers(ops);
    let mut report = LaunchReport::default();
    for (at, _) in ops.match_indices("launch") {
        let prev = if at > 0 { ops.as_bytes()[at - 1] } else { b' ' };
        if prev == b'.' || is_ident_byte(prev) {
            continue; // a method (cuDNN's `fwd.launch(`) or another name
        }
        let rest = &ops[at + "launch".len()..];
        let shape = rest.starts_with("_shape(");
        if !(shape || rest.starts_with('(')) || ops[..at].trim_end().ends_with("fn") {
            continue;
        }
        let open = at
            + if shape {
                "launch_shape".len()
            } else {
                "launch".len()
            };
        let fn_at = {
            let mut end = at;
            loop {
                match ops[..end].rfind("fn ") {
                    Some(i) if i > 0 && is_ident_byte(ops.as_bytes()[i - 1]) => end = i,
                    found => break found.unwrap_or(0),
                }
            }
        };
        let fn_name = ops[fn_at + 3..].split('(').next().unwrap_or("").trim();
        if matches!(fn_name, "launch" | "launch_shape") {
            continue; // the wrapper forwarding its caller's launch
        }
        let site = format!("ops.rs:{}", ops[..at].matches('\n').count() + 1);
        let Some(close) = closing(ops, open) else {
            report
                .failures
                .push(format!("{site}: the launch call does not close"));
            continue;
        };
        let call = split_top(&ops[open + 1..close]);
        let n_args = if shape { 6 } else { 5 };
        if call.len() != n_args {
            report.skipped.push(format!(
                "{site}: {} arguments to the launch call",
                call.len()
            ));
            continue;
        }
        let Some(module) = string_literal(call[1]) else {
            report.skipped.push(format!(
                "{site}: module `{}` is not a literal",
                short(call[1])
            ));
            continue;
        };
        let groups = match resolve(ops, &ops[fn_at..at], call[2], call[n_args - 1]) {
            Ok(groups) => groups,
            Err(why) => {
                report
                    .skipped
                    .push(format!("{site} ({module}, in fn {fn_name}): {why}"));
                continue;
            }
        };
        report.sites += 1;
        for group in groups {
            let mut fitted = vec![false; group.lists.len()];
            let mut all_fit = true;
            for name in &group.names {
                let label = format!("{module}::{name}");
                let Some((_, _, params)) =
                    kernels.iter().find(|(m, k, _)| *m == module && k == name)
                else {
                    report.failures.push(format!(
                        "{site}: launches {label}, which {module}.cu does not define"
                    ));
                    all_fit = false;
                    continue;
                };
                let whys: Vec<Option<String>> = group
                    .lists
                    .iter()
                    .map(|l| mismatch(l, params, &helpers))
                    .collect();
                for (f, why) in fitted.iter_mut().zip(&whys) {
                    *f |= why.is_none();
                }
                if whys.iter().any(Option::is_none) {
                    report.checked.push(format!("{site} {label}"));
                    continue;
                }
                all_fit = false;
                let n = whys.len();
                let whys: Vec<String> = whys
                    .into_iter()
                    .flatten()
                    .enumerate()
                    .map(|(i, w)| {
                        if n > 1 {
                            format!("[argument list {} of {n}] {w}", i + 1)
                        } else {
                            w
                        }
                    })
                    .collect();
                report
                    .failures
                    .push(format!("{site}: {label}: {}", whys.join(" / ")));
            }
            for (i, f) in fitted.iter().enumerate() {
                if all_fit && !f {
                    report.failures.push(format!(
                        "{site}: argument list {} of {} ({}) fits none of {}",
                        i + 1,
                        fitted.len(),
                        short(&group.lists[i].join(", ")),
                        group.names.join(", ")
                    ));
                }
            }
        }
    }
    report
}

/// The checker itself on a small inline ops.rs and .cu: every form the
/// real launches use resolves, a right launch passes, and a wrong one is
/// named with its argument and the kinds.
fn launch_checker_self_check() {
    let ops = r#"
fn ptr(t: &Tensor) -> Arg {
    Arg::Ptr(t.device_address())
}
fn n64(n: usize) -> Arg {
    Arg::I64(n as i64)
}
fn i32_arg(op: &'static str, v: usize) -> Result<Arg> {
    i32::try_from(v).map(Arg::I32).map_err(|_| bad(op))
}
fn extra(g: &G) -> Result<Vec<Arg>> {
    Ok(vec![i32_arg("extra", g.a)?, Arg::F32(g.b)])
}
fn good(x: &Tensor, g: &G, flag: bool) -> Result<()> {
    let name = match x.dtype() {
        DType::BF16 => "k_bf16",
        _ => "k_f32",
    };
    let mut args = vec![ptr(x), n64(n)];
    args.extend(extra(g)?);
    if flag {
        args.push(Arg::I32(1));
    }
    launch(&st, "m", name, n, &args)?;
    // launch(&st, "m", "gone", n, &[]) is a comment
    let half = if flag { "two" } else { "two" };
    launch_shape(&st, "m", &format!("{half}"), (1, 1, 1), (32, 1, 1), &[ptr(x), Arg::F32(c)])
}
fn pair(x: &Tensor, back: bool) -> Result<()> {
    let (name, mut args) = if back {
        ("k_bf16", vec![ptr(x), n64(n), i32_arg("pair", 2)?])
    } else {
        ("two", vec![ptr(x)])
    };
    args.extend([Arg::F32(c)]);
    launch(&st, "m", name, n, &args)
}
fn bad(x: &Tensor) -> Result<()> {
    launch(&st, "m", "two", n, &[ptr(x), i32_arg(op, n)?])?;
    launch(&st, "m", "k_bf16", n, &[ptr(x)])
}
"#;
    let cu = "extern \"C\" __global__ void k_f32(float* x, long long n, int a, float b,\n\
              \x20   int flag) {}\n\
              /* extern \"C\" __global__ void two(int x) {} */\n\
              extern \"C\" __global__ void k_bf16(const unsigned short* __restrict__ x,\n\
              \x20   long long n, int a, float b) {}\n\
              extern \"C\" __global__ void two(float* x, float c) {}\n";
    let r = check_launches(ops, &[("m", cu)]);
    assert!(r.skipped.is_empty(), "self-check skipped {:?}", r.skipped);
    assert_eq!(r.sites, 5, "self-check launch sites: {:?}", r.checked);
    assert_eq!(r.checked.len(), 5, "self-check checked: {:?}", r.checked);
    assert_eq!(
        r.failures.len(),
        2,
        "self-check failures: {:#?}",
        r.failures
    );
    let kind = &r.failures[0];
    for part in ["m::two", "argument 2 of 2", "expected float", "found int"] {
        assert!(
            kind.contains(part),
            "self-check: {part:?} missing from {kind}"
        );
    }
    let count = &r.failures[1];
    for part in ["m::k_bf16", "1 arguments passed, the kernel takes 4"] {
        assert!(
            count.contains(part),
            "self-check: {part:?} missing from {count}"
        );
    }
}

/// Every kernel launch of `src/backend/cuda/ops.rs` passes as many
/// arguments as its kernel (in `kernels/*.cu`) takes, each of the kind of
/// its parameter (pointer, `long long`, `int`, `float`), in order: a
/// mismatch would be undefined behaviour at the first launch on a GPU
/// (cuLaunchKernel reads each parameter's size from the slot given).
/// Resolves kernel names given by literal, by a binding of literals (a
/// `match` or `if`), or by `format!` of one such binding, and argument
/// lists given inline or by `let args = [..]` / `vec![..]` with `push` and
/// `extend` (one in an `if` may or may not run: each kernel then takes one
/// of the lists, and each list fits one of the kernels). Needs no NVRTC.
#[test]
fn every_launch_passes_the_kernels_parameter_kinds() {
    launch_checker_self_check();
    let ops = include_str!("../src/backend/cuda/ops.rs");
    // Every variant of `enum Arg` has a kind here.
    let enum_at = ops.find("enum Arg {").expect("ops.rs defines enum Arg");
    let enum_body = &ops[enum_at..enum_at + ops[enum_at..].find('}').expect("enum Arg closes")];
    let enum_body = blank_comments(enum_body);
    for line in enum_body.lines().skip(1) {
        let variant = line.trim().split('(').next().unwrap_or("").trim();
        if !variant.is_empty() {
            assert!(
                ARG_VARIANTS
                    .iter()
                    .any(|(v, _)| *v == format!("Arg::{variant}")),
                "Arg::{variant} of ops.rs has no kernel parameter kind in this test"
            );
        }
    }
    let report = check_launches(ops, KERNEL_SOURCES);
    for c in &report.checked {
        println!("checked {c}");
    }
    for s in &report.skipped {
        println!("skipped {s}");
    }
    println!(
        "{} launch calls, {} kernel launches checked, {} skipped, {} mismatched",
        report.sites,
        report.checked.len(),
        report.skipped.len(),
        report.failures.len()
    );
    assert!(
        report.failures.is_empty(),
        "launch arguments that do not fit their kernel's parameters:\n{}",
        report.failures.join("\n")
    );
    assert!(
        report.sites >= 30 && report.checked.len() >= 43,
        "only {} launch calls and {} kernel launches resolved (skipped: {:#?})",
        report.sites,
        report.checked.len(),
        report.skipped
    );
}

/// The architecture kernels are compiled for is one this NVRTC knows: the
/// card's own, or for a card newer than NVRTC the newest it knows (its PTX
/// runs on newer cards), which compiles.
#[test]
fn kernels_compile_for_an_architecture_nvrtc_knows() {
    use memfit::backend::cuda::{nvrtc_arch, supported_archs};
    if !nvrtc_or_skip() {
        return;
    }
    let archs = supported_archs();
    assert!(archs.contains(&75) && archs.contains(&90), "{archs:?}");
    assert_eq!(nvrtc_arch((9, 0)), "compute_90");
    assert_eq!(nvrtc_arch((7, 5)), "compute_75");
    let newest = *archs.iter().max().expect("NVRTC lists its architectures");
    let arch = nvrtc_arch((99, 9));
    assert_eq!(arch, format!("compute_{newest}"));
    let (name, source) = KERNEL_SOURCES[0];
    compile(name, source, Box::leak(arch.into_boxed_str())).expect("compiles for the newest");
}
