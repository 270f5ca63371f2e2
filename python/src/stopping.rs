//! Ending what a dropped Python object held (a store's session, a transfer engine) where the drop
//! happens: a Python thread holding the GIL, or a runtime's thread (the garbage collector may run
//! there). Blocking there stalls every Python thread or cannot be done at all (a runtime cannot
//! be entered from another's thread).

use pyo3::Python;

/// Runs `stop` on a thread of its own named `name`, and waits for it with the GIL released, but
/// only outside any runtime; `what` names it in the logs.
pub fn stop_off_thread(name: &str, what: &str, stop: impl FnOnce() + Send + 'static) {
    let stopping = std::thread::Builder::new().name(name.into()).spawn(stop);
    match stopping {
        Ok(stopping) if tokio::runtime::Handle::try_current().is_err() => {
            Python::attach(|py| py.detach(|| stopping.join()))
                .unwrap_or_else(|_| tracing::warn!("stopping {what} panicked"));
        }
        Ok(_) => {}
        // `stop` went with the failed spawn: what it held stops in its own drop.
        Err(e) => tracing::warn!(error = %e, "cannot start a thread to stop {what}"),
    }
}
