//! What an upstream's permit loop (`crate::exec::permits`) shares with the rest of the
//! process: where its ceiling comes from, and what a worker pod's grant says.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};

/// Where an upstream's ceiling comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `serve`: `max_concurrency` is the ceiling, and the governor runs here.
    Local,
    /// A worker pod: the grant is the ceiling, already adapted by the controller.
    Granted,
}

/// What the loop shares with the rest of the process.
#[derive(Default)]
pub struct Control {
    /// The ceiling a worker pod's grant sets (`Mode::Granted`).
    pub grant: AtomicU32,
    /// How many worker pods the grant says send to the upstream (`Mode::Granted`).
    pub sharing: AtomicU32,
    /// This worker pod's place among them, for turns at the probe (`Mode::Granted`).
    pub turn: AtomicU32,
    /// The users' requests at the upstream, in thousandths, as the grant says
    /// (`Mode::Granted`; `u64::MAX`: it does not say yet).
    pub users: AtomicU64,
    /// The load signal's last reading was set aside as stale ([`super::staleness`]): a
    /// worker pod says so in its acknowledgment, and the controller warns on its Batch.
    pub signal_stale: AtomicBool,
    /// A worker pod's load signal says its batch is alone at the server, its places
    /// known: its own caps fill them ([`super::headroom`]), and the controller's
    /// throughput rule stands aside while every pod says so.
    pub filling: AtomicBool,
}
