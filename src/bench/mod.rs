//! The benchmarks behind `memfit bench`: timed training steps on a fixed
//! synthetic batch ([`step`]), one such step per memory strategy as a table
//! ([`strategies`]), and the largest batch that fits a budget per strategy,
//! predicted without training ([`max_batch`]), and the same step on 1, 2,
//! … data-parallel processes ([`scaling`]). Functions take plain option
//! structs and return results; what they report as they go is written to
//! the `out` they are given (stdout for the binary), progress to stderr.
//! They know the engine's public layers, not the command line's parser.

pub mod max_batch;
pub mod scaling;
pub mod step;
pub mod strategies;

pub use max_batch::{
    MaxBatchRow, MaxBatchStrategy, format_max_batch_header, format_max_batch_row, largest_batch,
    max_batch_strategies,
};
pub use scaling::{ScalingOptions, ScalingRow, format_scaling, run_scaling};
pub use step::{StepOptions, StepResult, format_profile, measure_steps, measure_steps_on};
pub use strategies::{
    StrategiesOptions, StrategyRow, format_strategies, pytorch_rows, run_strategies, strategy_rows,
};

/// `writeln!` into a report, a failed write as [`crate::Error::Output`].
macro_rules! outln {
    ($out:expr, $($arg:tt)*) => {
        writeln!($out, $($arg)*).map_err($crate::Error::Output)?
    };
}
pub(crate) use outln;
