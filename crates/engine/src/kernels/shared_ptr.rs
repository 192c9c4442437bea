//! [`SharedMut`]: one raw pointer that parallel tasks write disjoint elements through (the
//! attention's heads into their columns of the output, the bf16 gemm's tasks into their tiles
//! of C). The one place the engine shares a mutable buffer across threads without a lock.

/// A raw pointer to a buffer whose elements parallel tasks write, each task its own disjoint
/// set (its own columns, block or tiles). Send and Sync so closures on the rayon pool can
/// capture it; the callers' `// SAFETY:` comments say why their accesses are disjoint.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub(crate) *mut T);

// SAFETY: the wrapper only carries the address; every access goes through the unsafe
// [`SharedMut::at`], whose contract (index inside the buffer, no concurrent access to the same
// element) is what makes sending it to another thread sound.
unsafe impl<T> Send for SharedMut<T> {}
// SAFETY: as for `Send`: sharing the address is harmless, each dereference is the caller's
// obligation under the contract of [`SharedMut::at`].
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// Element `i` (a method, so closures capture the wrapper and not the bare pointer).
    ///
    /// # Safety
    /// `i` must lie inside the buffer, and no other thread may touch element `i` while the
    /// returned pointer is used.
    #[inline]
    pub(crate) unsafe fn at(&self, i: usize) -> *mut T {
        // SAFETY: the caller guarantees that `i` lies inside the buffer `self.0` points to, so
        // the offset stays inside one allocation.
        unsafe { self.0.add(i) }
    }
}
