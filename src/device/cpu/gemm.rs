//! The one door to the `gemm` crate. It hides the crate's raw pointers and
//! its `dst = alpha*dst + beta*lhs*rhs` argument order behind a checked,
//! slice-based call.

use gemm::Parallelism;

/// Whether the product is added to the destination or replaces it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accumulate {
    Yes,
    No,
}

/// A read-only strided matrix view: element (i, j) is `data[i*rs + j*cs]`.
#[derive(Clone, Copy)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major (rows, cols) matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// Rows `r0..r1` of the matrix; no data moves.
    pub fn row_range(self, r0: usize, r1: usize) -> Self {
        assert!(
            r0 <= r1 && r1 <= self.rows,
            "MatRef::row_range: rows out of range"
        );
        let data = if r0 == r1 {
            &self.data[..0]
        } else {
            &self.data[r0 * self.rs..]
        };
        MatRef {
            data,
            rows: r1 - r0,
            ..self
        }
    }

    /// The transpose view; no data moves.
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// Largest index touched plus one (0 for an empty matrix).
    fn extent(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            (self.rows - 1) * self.rs + (self.cols - 1) * self.cs + 1
        }
    }
}

#[cfg(test)]
impl<'a> MatRef<'a> {
    /// A (rows, cols) view of `data`, stored as a (cols, rows) row-major
    /// matrix when `transposed`: the two layouts the GEMM tests cover.
    pub(crate) fn test_view(data: &'a [f32], rows: usize, cols: usize, transposed: bool) -> Self {
        if transposed {
            MatRef::row_major(data, cols, rows).t()
        } else {
            MatRef::row_major(data, rows, cols)
        }
    }
}

/// `dst (m, n) row-major [+]= a (m, k) · b (k, n)`, parallel over rayon's pool.
///
/// Panics if the views do not fit their slices or the shapes disagree; both
/// are engine bugs, never user input.
pub fn gemm_f32(dst: &mut [f32], a: MatRef<'_>, b: MatRef<'_>, acc: Accumulate) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "gemm: inner dimensions {k} vs {}", b.rows);
    assert!(
        dst.len() >= m * n,
        "gemm: dst holds {} < {m}x{n}",
        dst.len()
    );
    assert!(a.extent() <= a.data.len(), "gemm: lhs view out of bounds");
    assert!(b.extent() <= b.data.len(), "gemm: rhs view out of bounds");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if acc == Accumulate::No {
            dst[..m * n].fill(0.0);
        }
        return;
    }
    // Small products are not worth waking the thread pool.
    let parallelism = if m * n * k < 64 * 64 * 64 {
        Parallelism::None
    } else {
        Parallelism::Rayon(0)
    };
    // SAFETY: the asserts above guarantee that every index the kernel reads
    // (`a`, `b` through their strides) and writes (`dst`, row-major m x n)
    // lies inside the corresponding slice; `dst` is borrowed mutably, so it
    // cannot alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            /* dst: */ dst.as_mut_ptr(),
            /* dst_cs: */ 1,
            /* dst_rs: */ n as isize,
            /* read_dst: */ acc == Accumulate::Yes,
            /* lhs: */ a.data.as_ptr(),
            /* lhs_cs: */ a.cs as isize,
            /* lhs_rs: */ a.rs as isize,
            /* rhs: */ b.data.as_ptr(),
            /* rhs_cs: */ b.cs as isize,
            /* rhs_rs: */ b.rs as isize,
            /* alpha (scales dst): */ 1.0,
            /* beta (scales a·b): */ 1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: MatRef<'_>, b: MatRef<'_>) -> Vec<f64> {
        let mut out = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                for p in 0..a.cols {
                    out[i * b.cols + j] +=
                        a.data[i * a.rs + p * a.cs] as f64 * b.data[p * b.rs + j * b.cs] as f64;
                }
            }
        }
        out
    }

    #[test]
    fn matches_naive_with_transposes_and_accumulate() {
        let (m, k, n) = (37, 19, 23);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
            .collect();
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let av = MatRef::test_view(&a, m, k, ta);
            let bv = MatRef::test_view(&b, k, n, tb);
            let want = naive(av, bv);
            let mut dst = vec![1.0f32; m * n];
            gemm_f32(&mut dst, av, bv, Accumulate::Yes);
            for (d, w) in dst.iter().zip(&want) {
                assert!((*d as f64 - (w + 1.0)).abs() < 1e-4, "{d} vs {}", w + 1.0);
            }
            gemm_f32(&mut dst, av, bv, Accumulate::No);
            for (d, w) in dst.iter().zip(&want) {
                assert!((*d as f64 - w).abs() < 1e-4);
            }
        }
    }
}
