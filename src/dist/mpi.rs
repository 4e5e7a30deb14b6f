//! [`Collective`] on MPI (feature `mpi`): the `mpi` crate (rsmpi) over the
//! system's Open MPI or MPICH. `mpirun`/`srun` start the processes; the
//! world communicator is the run. MPI's default error handler aborts every
//! rank on a failed call, so a dead rank ends the run rather than hanging.

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::Collective;
use crate::error::{Error, Result};

/// The MPI world; finalises MPI when dropped.
pub struct Mpi {
    world: SimpleCommunicator,
    // Declared last: dropped after the communicator, finalising MPI.
    _universe: Universe,
}

impl Mpi {
    /// Initialises MPI (once per process).
    pub fn init() -> Result<Self> {
        let universe = mpi::initialize().ok_or_else(|| {
            Error::invalid(
                "distributed run",
                "MPI is already initialised in this process",
            )
        })?;
        Ok(Mpi {
            world: universe.world(),
            _universe: universe,
        })
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }
    fn size(&self) -> usize {
        self.world.size() as usize
    }
    fn broadcast_f32(&self, buf: &mut [f32]) -> Result<()> {
        self.world.process_at_rank(0).broadcast_into(buf);
        Ok(())
    }
    fn broadcast_bytes(&self, buf: &mut [u8]) -> Result<()> {
        self.world.process_at_rank(0).broadcast_into(buf);
        Ok(())
    }
    fn sum_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        // rsmpi has no in-place all-reduce: a separate receive buffer.
        self.world
            .all_reduce_into(send, recv, SystemOperation::sum());
        Ok(())
    }
    fn sum_f64(&self, send: &[f64], recv: &mut [f64]) -> Result<()> {
        self.world
            .all_reduce_into(send, recv, SystemOperation::sum());
        Ok(())
    }
    fn all_equal(&self, v: u64) -> Result<bool> {
        let (mut lo, mut hi) = (0u64, 0u64);
        self.world
            .all_reduce_into(&v, &mut lo, SystemOperation::min());
        self.world
            .all_reduce_into(&v, &mut hi, SystemOperation::max());
        Ok(lo == hi)
    }
    fn barrier(&self) -> Result<()> {
        self.world.barrier();
        Ok(())
    }
    fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}
