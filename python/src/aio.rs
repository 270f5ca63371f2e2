//! asyncio awaitables over the store's own I/O runtime. An `async_*` call makes a future on the
//! caller's running event loop, spawns its work as a task of the runtime (no thread per call:
//! many calls in flight share the runtime's few threads and overlap their transfers), and the
//! task hands the result to the loop with `call_soon_threadsafe`. A call the caller cancels
//! (`task.cancel()`, `asyncio.wait_for`'s timeout) stops at its next wait, and nothing is
//! reported: a put not ended yet is revoked (nothing is stored under its keys), a get stops
//! writing into the caller's memory (what it wrote stays). A transfer step already running on
//! threads of its own (a batch of tens of MiB to one owner) or a same-host copy ends first, so a
//! buffer is safe to reuse only once the call would have ended. A call that panics resolves with
//! a RuntimeError instead of leaving its awaitable pending forever.

use std::{
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    task::{Context, Poll},
};

use pyo3::{exceptions::PyRuntimeError, prelude::*, sync::PyOnceLock, types::PyCFunction};
use tokio::runtime::{Handle, RuntimeFlavor};

/// Runs `work` on `rt` and returns an asyncio future of `finish(work's output)`.
pub fn spawn<T, W, F>(py: Python<'_>, rt: &Handle, work: W, finish: F) -> PyResult<Py<PyAny>>
where
    T: Send + 'static,
    W: Future<Output = T> + Send + 'static,
    F: for<'py> FnOnce(Python<'py>, T) -> PyResult<Bound<'py, PyAny>> + Send + 'static,
{
    if rt.runtime_flavor() == RuntimeFlavor::CurrentThread {
        return Err(PyRuntimeError::new_err(
            "async calls need the store's I/O threads: use MooncakeDistributedStoreAsync, or set \
             MOONCAKE_IO_THREADS to 1 or more before setup()",
        ));
    }
    let event_loop = py.import("asyncio")?.call_method0("get_running_loop")?;
    let future = event_loop.call_method0("create_future")?;
    let (loop_ref, future_ref) = (event_loop.unbind(), future.clone().unbind());
    let task = rt.spawn(async move {
        let out = CatchPanic(Box::pin(work)).await;
        Python::attach(|py| {
            let result = match out {
                Ok(out) => finish(py, out),
                Err(panic) => {
                    let why = panic_message(panic.as_ref());
                    tracing::error!("an async call panicked: {why}");
                    Err(PyRuntimeError::new_err(format!(
                        "the call failed inside: {why}"
                    )))
                }
            };
            let (value, error) = match result {
                Ok(v) => (v, py.None().into_bound(py)),
                Err(e) => (
                    py.None().into_bound(py),
                    e.into_value(py).into_bound(py).into_any(),
                ),
            };
            let delivered = resolver(py).and_then(|resolve| {
                loop_ref.call_method1(
                    py,
                    "call_soon_threadsafe",
                    (resolve, future_ref, value, error),
                )
            });
            if let Err(e) = delivered {
                // The loop is closed: nobody is waiting any more.
                tracing::debug!(error = %e, "an async call finished after its event loop closed");
            }
        });
    });
    // The caller moves on from a cancelled call and may reuse its buffers: the work stops.
    let abort = task.abort_handle();
    let on_done = PyCFunction::new_closure(
        py,
        None,
        None,
        move |args: &Bound<'_, pyo3::types::PyTuple>,
              _kwargs: Option<&Bound<'_, pyo3::types::PyDict>>|
              -> PyResult<()> {
            if args.get_item(0)?.call_method0("cancelled")?.is_truthy()? {
                abort.abort();
            }
            Ok(())
        },
    )?;
    future.call_method1("add_done_callback", (on_done,))?;
    Ok(future.unbind())
}

/// `work`'s output, or the panic it ended in.
struct CatchPanic<W>(Pin<Box<W>>);

impl<W: Future> Future for CatchPanic<W> {
    type Output = std::thread::Result<W::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // A future that panicked is not polled again: its output is the panic.
        match std::panic::catch_unwind(AssertUnwindSafe(|| self.0.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    (panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// The `resolve` function as a Python callable, made once per process.
fn resolver(py: Python<'_>) -> PyResult<&Bound<'_, PyCFunction>> {
    static RESOLVE: PyOnceLock<Py<PyCFunction>> = PyOnceLock::new();
    RESOLVE
        .get_or_try_init(py, || {
            PyCFunction::new_closure(py, None, None, resolve).map(Bound::unbind)
        })
        .map(|f| f.bind(py))
}

/// `resolve(future, value, error)`, run on the event loop: sets the result or the exception
/// unless the caller cancelled the future.
fn resolve(
    args: &Bound<'_, pyo3::types::PyTuple>,
    _kwargs: Option<&Bound<'_, pyo3::types::PyDict>>,
) -> PyResult<()> {
    let (future, value, error): (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>) =
        args.extract()?;
    if future.call_method0("done")?.is_truthy()? {
        return Ok(());
    }
    if error.is_none() {
        future.call_method1("set_result", (value,))?;
    } else {
        future.call_method1("set_exception", (error,))?;
    }
    Ok(())
}

/// An awaitable that is done already, with `value`.
pub fn ready(py: Python<'_>, value: Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    let future = py
        .import("asyncio")?
        .call_method0("get_running_loop")?
        .call_method0("create_future")?;
    future.call_method1("set_result", (value,))?;
    Ok(future.unbind())
}
