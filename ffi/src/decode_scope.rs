//! Every decode of a context, whoever calls llama_decode (the engine, llama.cpp's warm-up, a
//! draft or MTP context inside common_speculative), passes through here (patches/0010).
//!
//! A model with expert tiers has one gate: its decodes run one at a time, and each has finished
//! on the device before the gate opens again (decode_end synchronises the context). So while a
//! thread holds the gate, no graph of any context over the model is in flight, and only that
//! thread may change the tiers' device memory (adaptation's swaps, the maps) or read the routing
//! logs the graphs write. `moe::Exclusive` is the proof of holding it, made here only.
//!
//! A decode that computed with data Strata could not supply (a ring copy or a PLE read failed)
//! returns -3 to its caller, and the reason is kept for [`take_failure`] on the same thread.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, RwLock};

use crate::sys;

/// llama_decode's result for a batch whose graphs computed but whose output is unusable.
pub(crate) const FAILED: i32 = -3;

#[derive(Default)]
struct Gate {
    busy: Mutex<bool>,
    cv: Condvar,
}

impl Gate {
    fn acquire(&self) {
        let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        while *busy {
            busy = self.cv.wait(busy).unwrap_or_else(|e| e.into_inner());
        }
        *busy = true;
    }

    fn release(&self) {
        *self.busy.lock().unwrap_or_else(|e| e.into_inner()) = false;
        self.cv.notify_one();
    }
}

static GATES: RwLock<Option<HashMap<usize, Arc<Gate>>>> = RwLock::new(None);

thread_local! {
    /// The gates this thread holds, by model, with how many decodes of it are open on this
    /// thread (a decode inside another's hooks would be the second).
    static HELD: RefCell<Vec<(usize, Arc<Gate>, u32)>> = const { RefCell::new(Vec::new()) };
    /// Why this thread's last decode failed with [`FAILED`], when Strata failed it.
    static FAILURE: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Gives `model`'s decodes a gate (its expert tiers are placed).
pub(crate) fn guard(model: usize) {
    let mut g = GATES.write().unwrap_or_else(|e| e.into_inner());
    g.get_or_insert_with(HashMap::new).entry(model).or_default();
}

/// Drops the gate of a model being freed.
pub(crate) fn forget(model: usize) {
    if let Some(m) = GATES.write().unwrap_or_else(|e| e.into_inner()).as_mut() {
        m.remove(&model);
    }
}

fn gate(model: usize) -> Option<Arc<Gate>> {
    GATES.read().ok()?.as_ref()?.get(&model).cloned()
}

fn holds(model: usize) -> bool {
    HELD.with(|h| h.borrow().iter().any(|(m, _, _)| *m == model))
}

pub(crate) fn begin(model: *const sys::llama_model) {
    let model = model as usize;
    FAILURE.with(|f| f.borrow_mut().take());
    let Some(g) = gate(model) else { return };
    let nested = HELD.with(|h| h.borrow_mut().iter_mut().find(|(m, _, _)| *m == model).map(|(_, _, n)| *n += 1).is_some());
    if !nested {
        g.acquire();
        HELD.with(|h| h.borrow_mut().push((model, g, 1)));
    }
}

/// After a ubatch's graph was submitted: where a layer of a zero-copy model computed few enough
/// rows to take the zero-copy form, it wrote its routing log, which the next ubatch would
/// overwrite; it is counted now.
pub(crate) fn ubatch_done(model: *const sys::llama_model, sched: sys::ggml_backend_sched_t, n_tokens: u32, n_outputs: i32) {
    let model = model as usize;
    if holds(model) && crate::moe::logs_routing(n_tokens, n_outputs) {
        // SAFETY: llama.cpp passes its context's live scheduler for the duration of the call.
        crate::step_trace::device_wait(|| unsafe { sys::ggml_backend_sched_synchronize(sched) });
        crate::moe::after_decode(model);
    }
}

/// Releases the gate on every way out, a panic in what runs before included.
struct Release(Arc<Gate>);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.release();
    }
}

pub(crate) fn end(model: *const sys::llama_model, ctx: *mut sys::llama_context, ret: i32) -> i32 {
    let id = model as usize;
    // The outermost decode of the model on this thread releases the gate.
    let held = HELD.with(|h| {
        let mut h = h.borrow_mut();
        let i = h.iter().position(|(m, _, _)| *m == id)?;
        h[i].2 -= 1;
        (h[i].2 == 0).then(|| h.swap_remove(i).1)
    });
    let _release = held.map(|g| {
        let r = Release(g);
        if !ctx.is_null() {
            // SAFETY: llama.cpp passes the context that just decoded, live for the call.
            crate::step_trace::device_wait(|| unsafe { sys::llama_synchronize(ctx) });
        }
        crate::step_trace::tiers(|| {
            crate::moe::after_decode(id);
            // SAFETY: this thread holds the model's gate and has synchronised the context that
            // decoded; every other context over the model ended its decode synchronised.
            crate::moe::adapt::after_batch(&unsafe { crate::moe::Exclusive::new(id) });
        });
        r
    });
    let failure = crate::moe::take_failure(id).or_else(|| crate::ple::take_failure(model));
    match failure {
        Some(why) => {
            FAILURE.with(|f| *f.borrow_mut() = Some(why));
            if ret == 0 {
                FAILED
            } else {
                ret
            }
        }
        None => ret,
    }
}

/// Why the calling thread's last decode failed, when Strata failed it (cleared by asking).
pub(crate) fn take_failure() -> Option<String> {
    FAILURE.with(|f| f.borrow_mut().take())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_decode_of_a_gated_model_waits_for_the_first_to_end() {
        let id = Box::new(0u8);
        let model = &*id as *const u8 as *const sys::llama_model;
        guard(model as usize);
        begin(model);
        let (tx, rx) = std::sync::mpsc::channel();
        let m = model as usize;
        let other = std::thread::spawn(move || {
            begin(m as *const sys::llama_model);
            tx.send(()).unwrap();
            end(m as *const sys::llama_model, std::ptr::null_mut(), 0)
        });
        assert!(rx.recv_timeout(std::time::Duration::from_millis(200)).is_err(), "the second decode began while the first ran");
        HELD.with(|h| h.borrow_mut().clear());
        gate(m).unwrap().release();
        rx.recv_timeout(std::time::Duration::from_secs(5)).expect("the second decode began once the first ended");
        forget(m);
        let _ = other.join();
    }

    #[test]
    fn a_decode_inside_a_decode_leaves_the_gate_to_the_outer_one() {
        let id = Box::new(0u8);
        let model = &*id as *const u8 as *const sys::llama_model;
        guard(model as usize);
        begin(model);
        begin(model);
        assert_eq!(end(model, std::ptr::null_mut(), 0), 0);
        assert!(holds(model as usize), "the outer decode still holds the gate");
        assert_eq!(end(model, std::ptr::null_mut(), 0), 0);
        assert!(!holds(model as usize));
        assert!(!*gate(model as usize).unwrap().busy.lock().unwrap(), "the gate is open again");
        forget(model as usize);
    }
}
