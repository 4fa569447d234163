//! The family's members (`benches/family.rs`): the simulated servers and llama-server's
//! configurations, and a member's server started.

use std::time::Duration;

use super::engine::LlamaServer;
use super::simulator::{SimConfig, Simulator};

/// A server of the family.
#[derive(Clone, Debug)]
pub enum Kind {
    Sim(SimConfig),
    Engine { model: &'static str, slots: usize },
}

pub struct Member {
    pub name: &'static str,
    pub kind: Kind,
    /// Sequences it runs at once: the fixed concurrencies tried are around it.
    pub places: u32,
}

fn sim(max_batch: usize, kv_capacity: u64, step_ms: u64, per_seq_us: u64) -> Kind {
    Kind::Sim(sim_config(max_batch, kv_capacity, step_ms, per_seq_us))
}

fn sim_config(max_batch: usize, kv_capacity: u64, step_ms: u64, per_seq_us: u64) -> SimConfig {
    SimConfig {
        max_batch,
        kv_capacity,
        step_base: Duration::from_millis(step_ms),
        step_per_seq: Duration::from_micros(per_seq_us),
        ..SimConfig::default()
    }
}

/// The family. A batch line holds ~22 prompt tokens and up to 32 generated in the KV
/// cache, a user's ~12 and 32: a cache of 1,800 tokens holds some 40 of them, 6,000
/// some 140.
pub fn family() -> Vec<Member> {
    let mut members = vec![
        Member { name: "sim 16 seqs, GPU-like step", kind: sim(16, 1_000_000, 5, 40), places: 16 },
        Member { name: "sim 16 seqs, CPU-like step", kind: sim(16, 1_000_000, 2, 2_000), places: 16 },
        Member { name: "sim 64 seqs, KV-bound", kind: sim(64, 1_800, 10, 20), places: 64 },
        Member { name: "sim 256 seqs, sequence-bound", kind: sim(256, 1_000_000, 20, 10), places: 256 },
        Member { name: "sim 256 seqs, KV-bound", kind: sim(256, 6_000, 20, 10), places: 256 },
        // Gauges set as SGLang's scheduler sets them: at each prefill batch and every 40
        // decode steps, so a request that finished stays counted until then.
        Member {
            name: "sim 64 seqs, gauges every 40 steps",
            kind: Kind::Sim(SimConfig { gauges_every: 40, ..sim_config(64, 1_000_000, 10, 20) }),
            places: 64,
        },
    ];
    let installed = std::env::var_os("LLAMA_SERVER").is_some()
        || super::tools::cache_dir().join("engine/bin/llama-server").exists();
    if installed {
        members.extend([
            Member { name: "llama-server tiny, 2 slots", kind: Kind::Engine { model: "tiny", slots: 2 }, places: 2 },
            Member { name: "llama-server tiny, 4 slots", kind: Kind::Engine { model: "tiny", slots: 4 }, places: 4 },
            Member { name: "llama-server tiny, 8 slots", kind: Kind::Engine { model: "tiny", slots: 8 }, places: 8 },
            Member { name: "llama-server small, 4 slots", kind: Kind::Engine { model: "small", slots: 4 }, places: 4 },
        ]);
    } else {
        println!("(llama-server is not installed: tests/tools/install-engine.sh; its members are left out)");
    }
    members
}

/// A member's server, running.
pub enum Server {
    Sim(Simulator),
    Engine(LlamaServer),
}

impl Server {
    pub async fn start(kind: &Kind) -> Self {
        match kind {
            Kind::Sim(config) => Self::Sim(Simulator::start(config.clone()).await),
            Kind::Engine { model, slots } => Self::Engine(LlamaServer::start(model, *slots).await),
        }
    }

    /// The OpenAI API's root (`…/v1`).
    pub fn api(&self) -> String {
        match self {
            Self::Sim(sim) => sim.url.clone(),
            Self::Engine(engine) => format!("{}/v1", engine.url),
        }
    }
}
