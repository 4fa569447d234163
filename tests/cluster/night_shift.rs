//! The night shift across worker pods: the pods of one batch, each reading the server's
//! load signal, do not hold each other back.

use crate::common;
use crate::operator::{Operator, Setup};

use std::time::Duration;

use common::client::{Client, ids, input};
use common::simulator::{SimConfig, Simulator};

/// A server whose steps slow with every sequence (a CPU's), with no users: four pods of
/// one batch, each reading the server's load signal, fill much of its places between them,
/// though each pod sees the others' lines at the server as traffic that is not its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_pods_of_a_batch_alone_at_a_server_fill_much_of_its_places() {
    // 20-ms steps, a millisecond more for each sequence: 32 make a step 2.6 times as long
    // as one, and still give 2.2 times the tokens of 8.
    let server = SimConfig {
        max_batch: 32,
        step_base: Duration::from_millis(20),
        step_per_seq: Duration::from_millis(1),
        default_max_tokens: 16,
        ..SimConfig::default()
    };
    let sim = Simulator::start(server).await;
    let upstream = format!(
        "  - name: sim\n    base_url: {url}\n    models: [\"sim-*\"]\n    max_concurrency: 64\n    \
         load_signal: {{url: \"{metrics}\"}}\n",
        url = sim.url,
        metrics = sim.metrics_url()
    );
    let setup =
        Setup { batches: "  max_running_shards: 4\n", upstreams: &upstream, ..Setup::new(200, Duration::ZERO, 16) };
    let operator = Operator::set_up(setup).await;
    let client = Client::new(&operator.api_url, common::PROJECT, common::KEY);
    let batch = client.create(&client.upload(input(&ids("line", 800), "sim-a")).await).await;
    let done = client.wait_terminal(batch["id"].as_str().unwrap(), Duration::from_secs(300)).await;
    assert_eq!(done["request_counts"]["completed"], 800, "{done}");
    let stats = sim.stats();
    let held = stats.decoded.values().sum::<u64>() as f64 / stats.steps.max(1) as f64;
    eprintln!("[night shift] four pods alone at a server of 32 places: {held:.1} places held on average");
    assert_eq!(stats.finished.values().sum::<u64>(), 800, "each line once: {stats:?}");
    assert!(stats.metrics_reads.values().sum::<u64>() > 0, "the pods read the server's load signal: {stats:?}");
    // With the signal read, 13.0 to 14.8 (each pod counts its siblings' lines as
    // other traffic). A line a pod would be 4.
    assert!(held >= 6.0, "the batch fills much of the server's places, not a line a pod: {held:.1} of 32");
}
