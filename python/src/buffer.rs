//! The Python buffer protocol, declared here because the limited API of CPython 3.10 (the abi3
//! floor of this wheel) does not include it although every CPython 3 exports it, with the
//! `Py_buffer` layout that 3.11 made part of the stable ABI. A `PyBytesView` holds the exporter's
//! buffer for as long as it lives and must be dropped with the GIL held; the slices it hands out
//! may cross into GIL-free code, as the bytes stay valid while the view is held. Only read-only
//! views are taken: reads land in registered memory or in buffers this crate allocates.

use std::{
    ffi::{c_char, c_int, c_void},
    marker::PhantomData,
    ptr,
};

use pyo3::{exceptions::PyTypeError, ffi, prelude::*};

#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | PYBUF_STRIDES;

/// A C-contiguous byte view of a Python object exporting the buffer protocol.
pub struct PyBytesView<'py> {
    // Boxed so the address handed to the exporter stays put.
    raw: Box<RawBuffer>,
    // Not Send: released under the GIL of the thread that took it.
    _py: PhantomData<Python<'py>>,
}

impl<'py> PyBytesView<'py> {
    /// A read-only view of `obj`'s bytes.
    pub fn readable(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        Self::get(obj, PYBUF_C_CONTIGUOUS)
    }

    fn get(obj: &Bound<'py, PyAny>, flags: c_int) -> PyResult<Self> {
        let mut raw = Box::new(RawBuffer {
            buf: ptr::null_mut(),
            obj: ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: ptr::null_mut(),
            shape: ptr::null_mut(),
            strides: ptr::null_mut(),
            suboffsets: ptr::null_mut(),
            internal: ptr::null_mut(),
        });
        // SAFETY: `obj` is a live object (we hold a Bound, hence the GIL) and `raw` points to a
        // writable Py_buffer-sized struct that outlives the call.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *raw, flags) };
        if rc != 0 {
            let err = PyErr::take(obj.py());
            let what = obj
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default();
            return Err(PyTypeError::new_err(format!(
                "expected a C-contiguous bytes-like object, got {what}{}",
                err.map(|e| format!(" ({e})")).unwrap_or_default()
            )));
        }
        Ok(PyBytesView {
            raw,
            _py: PhantomData,
        })
    }

    pub fn as_slice(&self) -> &[u8] {
        if self.raw.len == 0 {
            return &[];
        }
        // SAFETY: the exporter guarantees `buf` points to `len` contiguous bytes for as long as
        // the view is held, which outlives the returned borrow. Python code running concurrently
        // on another thread may change the bytes (as with any C extension releasing the GIL);
        // they are plain data, so that can only make the transfer carry those bytes.
        unsafe { std::slice::from_raw_parts(self.raw.buf as *const u8, self.raw.len as usize) }
    }
}

impl Drop for PyBytesView<'_> {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released exactly
        // once; the lifetime ties it to a GIL-holding scope.
        unsafe { PyBuffer_Release(&mut *self.raw) }
    }
}

/// A new bytearray (or an instance of a bytearray subclass) that a read fills without the GIL:
/// nothing else can reach the object until it is handed to Python, so its bytes can be written
/// from any thread, and it cannot be resized meanwhile.
pub struct FreshByteArray {
    obj: Py<pyo3::types::PyByteArray>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the object is referenced only by this value until `into_object`; the bytes behind
// `ptr` are plain memory owned by that object, valid while `obj` holds it alive.
unsafe impl Send for FreshByteArray {}

impl FreshByteArray {
    /// `cls(len)`: a bytearray of `len` zero bytes (or of a subclass that `cls` names).
    pub fn new(cls: &Bound<'_, pyo3::types::PyType>, len: usize) -> PyResult<Self> {
        let obj = cls.call1((len,))?;
        let ba = obj.cast_into::<pyo3::types::PyByteArray>()?;
        if ba.len() != len {
            return Err(PyTypeError::new_err(format!(
                "{}({len}) made {} bytes",
                cls.name()?,
                ba.len()
            )));
        }
        // SAFETY: a bytearray's storage is `len` bytes at this address until it is resized,
        // which nothing can do before `into_object` hands the object out.
        let ptr = ba.data();
        Ok(FreshByteArray {
            obj: ba.unbind(),
            ptr,
            len,
        })
    }

    pub fn into_object(self) -> Py<pyo3::types::PyByteArray> {
        self.obj
    }

    /// The buffer maker of a read (`Client::batch_get_alloc`) that makes `cls(size)` for each
    /// size, taking the GIL once for the batch from whichever thread the read runs on (once per
    /// key, a busy Python thread cost a switch interval, 5 ms, per key).
    pub fn maker(
        cls: &Py<pyo3::types::PyType>,
    ) -> impl FnOnce(&[usize]) -> Vec<Result<FreshByteArray, mooncake_client::ClientError>> + '_
    {
        move |sizes| {
            Python::attach(|py| {
                let cls = cls.bind(py);
                sizes
                    .iter()
                    .map(|&size| {
                        FreshByteArray::new(cls, size).map_err(|e| {
                            mooncake_client::ClientError::Invalid(format!(
                                "allocating {size} bytes: {e}"
                            ))
                        })
                    })
                    .collect()
            })
        }
    }
}

impl AsMut<[u8]> for FreshByteArray {
    fn as_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: see `new`: `len` bytes at `ptr`, reachable only through this value.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// A `PyBytesView` that may move to another thread (an async call's task) and be dropped there:
/// it takes the GIL to release the exporter's buffer.
pub struct SendableView {
    raw: Box<RawBuffer>,
}

// SAFETY: the view only reads plain bytes that the exporter keeps valid until the buffer is
// released, and the release in `drop` runs with the GIL held, from whichever thread.
unsafe impl Send for SendableView {}

impl PyBytesView<'_> {
    /// This view, to be used and released from any thread.
    pub fn into_sendable(self) -> SendableView {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so the box is moved out exactly once.
        let raw = unsafe { ptr::read(&this.raw) };
        SendableView { raw }
    }
}

impl SendableView {
    pub fn as_slice(&self) -> &[u8] {
        if self.raw.len == 0 {
            return &[];
        }
        // SAFETY: as in `PyBytesView::as_slice`: the exporter keeps `len` bytes at `buf` until
        // the release in `drop`.
        unsafe { std::slice::from_raw_parts(self.raw.buf as *const u8, self.raw.len as usize) }
    }
}

/// Views released together, under one GIL (see `SendableView`): an async put of many values
/// takes it once, not once per value.
pub struct SendableViews(pub Vec<SendableView>);

impl Drop for SendableViews {
    fn drop(&mut self) {
        // Each view's own release then finds the GIL held.
        Python::attach(|_| self.0.clear());
    }
}

impl Drop for SendableView {
    fn drop(&mut self) {
        Python::attach(|_| {
            // SAFETY: filled by a successful PyObject_GetBuffer, released exactly once, with the
            // GIL held.
            unsafe { PyBuffer_Release(&mut *self.raw) }
        });
    }
}
