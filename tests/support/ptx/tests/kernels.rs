//! The real kernels: every source parses for both architectures, and a few
//! run against results computed here.

mod common;

use common::*;
use memfit_ptx::{Module, launch};

#[test]
fn every_kernel_parses() {
    let Some(nv) = Nvrtc::load() else { return };
    let mut count = 0;
    for (name, src) in kernel_sources() {
        for arch in ["compute_75", "compute_90"] {
            let ptx = nv.compile(&name, &src, arch);
            let m = Module::parse(&ptx).unwrap_or_else(|e| panic!("{name} ({arch}): {e}"));
            assert!(!m.kernel_names().is_empty(), "{name}: no kernels");
            count += m.kernel_names().len();
        }
    }
    eprintln!("{count} kernels parsed");
}
