//! A linearizability checker for histories of a key-value store: puts, gets, deletes, exists and
//! insert-if-absent, one key each, with optional TTLs. Tests record what real clients did
//! (through a [`Recorder`], or by building a [`History`]), and [`check()`] says whether some legal
//! execution of the store explains every answer.
//!
//! ## The algorithm
//!
//! A history is linearizable if and only if each key's sub-history is (every operation touches
//! one key, and linearizability is local), so keys are checked separately, in parallel. On each
//! key the search is Wing & Gong's, with Lowe's memoisation, as Porcupine and Knossos do it: place
//! operations one at a time in an order compatible with real time (nothing is placed after an
//! operation that completed before it was invoked), step a model of the key with each, backtrack
//! when no operation fits, and never explore twice the same (set of placed operations, model
//! state), kept as a bitset and a small hashable state in a hash set. To stay fast with dozens of
//! concurrent clients on one key, the search orders candidates the way linearizations usually
//! look, places a read that fits at once where that provably loses nothing, cuts orders that
//! overwrite a value some later get still returns, and merges values no later get returns; none
//! of this changes the verdict. The private modules `search` and `model` document the details.
//!
//! Beside the search, two direct checks look for patterns that need no search and say what went
//! wrong in the store's terms: two insert-if-absent that both inserted while the first value was
//! certainly still there ([`Violation::DoubleInsert`]), and an acknowledged write missing from a
//! later read with nothing that could have replaced or expired it ([`Violation::LostWrite`]).
//!
//! ## Outcomes
//!
//! Operations the store refused ([`Outcome::Failed`]) are dropped. So are reads whose outcome is
//! unknown: they constrain nothing. A write whose outcome is unknown may have taken effect at any
//! time after its invocation, however late, or never: it is placed like any operation but with no
//! completion, so it never forces anything after it, and the search ends as soon as every answered
//! operation is placed (leaving a write out is the same as placing it after everything observed).
//!
//! ## TTLs and clocks, and why the check is sound
//!
//! Times come from the clients' clock; the store decides expiry by its own. The model assumes:
//!
//! - each operation takes effect at one point inside `[invoked_ms, completed_ms]` (widened by
//!   [`CheckOptions::client_clock_skew_ms`] if the clients' clocks differ), the points
//!   non-decreasing in the order of effect;
//! - a value written with TTL `d` gets its expiry from the store's clock at some instant `a`
//!   between the write's invocation and its point (Cairn stamps a record when its leader appends
//!   it), and is live at points before `a + d` and absent from it on, by the store's clock;
//! - the store's clock is within [`CheckOptions::clock_tolerance_ms`] `t` of the clients', but not
//!   necessarily by the same error at the write and at a read; so on the clients' clock the
//!   expiry `E` lies in `[invoked + d - 2t, point + d + 2t]` (and before `completed + d + 2t`).
//!
//! The search keeps, instead of concrete times, the earliest possible current point and an
//! interval for the current value's expiry linked to it (every constraint is a difference
//! between two times, and the state is their exact projection), branching where an answer does
//! not say which case happened. So every execution within these assumptions is considered: a
//! reported violation is one that no such execution explains (soundness), and a history that none
//! explains is reported (precision up to the assumptions). The direct checks use the same bounds
//! and are sound on their own.
//!
//! ## What it does not know
//!
//! It knows nothing of Cairn's wire protocol or processes: it sees only calls, answers and times.
//! It does not check anything across keys (there are no multi-key operations in its model), nor
//! durability across restarts beyond what later reads show, nor performance.

mod check;
mod direct;
mod history;
mod model;
mod report;
mod search;

pub use check::{CheckOptions, ORDER_TAIL_SHOWN, check};
pub use history::{Call, History, Operation, Outcome, Output, Pending, Recorder};
pub use report::{Inconclusive, Report, Violation};
