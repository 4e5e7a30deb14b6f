//! Compute backends. Only the CPU exists so far; `cuda` will sit beside it.

pub mod cpu;
