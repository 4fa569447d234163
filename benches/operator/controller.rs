//! The operator bench's controller: a `nightshift controller` process on the test
//! cluster, and what it says of itself (its `/metrics`: the reconcile passes' histogram
//! and its errors by reason; its memory and CPU from `/proc`).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{cluster, ports};

/// How long a controller may take to lead.
const LEAD_DEADLINE: Duration = Duration::from_secs(60);

/// A controller process of this bench, killed on drop.
pub struct Controller {
    child: Child,
    metrics: String,
    http: reqwest::Client,
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `nightshift controller` on `namespace` (storage and log under `work`) and waits
/// until it leads.
pub fn start_controller(cluster: &cluster::TestCluster, namespace: &str, work: &Path) -> Controller {
    let binary = std::env::var("NIGHTSHIFT_BINARY")
        .unwrap_or_else(|_| format!("{}/target/release/nightshift", env!("CARGO_MANIFEST_DIR")));
    assert!(Path::new(&binary).exists(), "build the release binary first: cargo build --release");
    let config = work.join("nightshift.yaml");
    std::fs::write(&config, format!("storage:\n  dir: {}\n", work.join("data").display())).unwrap();
    let port = ports::claim_one();
    let log = work.join("controller.log");
    let mut child = Command::new(binary)
        .args(["controller", "--namespace", namespace, "--identity", "bench", "--config"])
        .arg(&config)
        .arg(format!("--probe-listen=127.0.0.1:{port}"))
        .env("KUBECONFIG", cluster.kubeconfig_path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().unwrap();
    let controller = Controller { child, metrics: format!("http://127.0.0.1:{port}/metrics"), http };
    let (leading, lead) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.contains("leading") {
                let _ = leading.send(());
            }
        }
    });
    if lead.recv_timeout(LEAD_DEADLINE).is_err() {
        cluster::print_tail("controller", &log);
        panic!("the controller did not lead within {LEAD_DEADLINE:?}");
    }
    controller
}

impl Controller {
    pub async fn scrape(&self) -> Scrape {
        let response = self.http.get(&self.metrics).send().await.and_then(reqwest::Response::error_for_status);
        match response {
            Ok(response) => parse_scrape(&response.text().await.unwrap_or_default()),
            Err(error) => {
                eprintln!("operator: scraping {} failed: {error}", self.metrics);
                Scrape::default()
            }
        }
    }

    /// Resident memory and its peak, in MB.
    pub fn rss_mb(&self) -> (f64, f64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        let field = |name: &str| -> f64 {
            let line = status.lines().find(|l| l.starts_with(name));
            line.and_then(|l| l.split_whitespace().nth(1)).and_then(|kb| kb.parse::<f64>().ok()).unwrap_or(0.0) / 1024.0
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// CPU seconds used so far, user and system (at Linux's 100 ticks a second).
    pub fn cpu_seconds(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        // After the command's closing parenthesis, field 3 (state) comes first: utime and
        // stime (fields 14 and 15) are the 12th and 13th.
        let fields: Vec<&str> = stat.rsplit_once(')').map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
        let ticks = |at: usize| fields.get(at).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
        (ticks(11) + ticks(12)) / 100.0
    }
}

/// A Prometheus histogram as scraped: cumulative counts by upper bound, its sum and count.
#[derive(Clone, Debug, Default)]
pub struct Histogram {
    buckets: Vec<(f64, f64)>,
    sum: f64,
    pub count: f64,
}

impl Histogram {
    /// What was observed since `earlier`, a scrape of the same histogram.
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let before = |at: usize| earlier.buckets.get(at).map_or(0.0, |(_, n)| *n);
        let buckets = self.buckets.iter().enumerate().map(|(at, &(le, n))| (le, n - before(at))).collect();
        Histogram { buckets, sum: self.sum - earlier.sum, count: self.count - earlier.count }
    }

    pub fn mean(&self) -> f64 {
        if self.count > 0.0 { self.sum / self.count } else { f64::NAN }
    }

    /// The `q` quantile, interpolated linearly within its bucket; the highest finite bound
    /// when it falls past it.
    pub fn quantile(&self, q: f64) -> f64 {
        let rank = q * self.count;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, n) in &self.buckets {
            if n >= rank && n > 0.0 {
                if le.is_infinite() {
                    return lower;
                }
                return lower + (le - lower) * (rank - below) / (n - below).max(f64::MIN_POSITIVE);
            }
            (lower, below) = (le, n);
        }
        f64::NAN
    }

    /// `mean 2.1 ms, p50 1.4, p99 9.8`.
    pub fn show(&self) -> String {
        let ms = |seconds: f64| seconds * 1000.0;
        format!("mean {:.1} ms, p50 {:.1}, p99 {:.1}", ms(self.mean()), ms(self.quantile(0.5)), ms(self.quantile(0.99)))
    }
}

/// The controller's reconcile figures from one scrape of its `/metrics`.
#[derive(Clone, Debug, Default)]
pub struct Scrape {
    pub passes: Histogram,
    pub errors: BTreeMap<String, f64>,
}

pub fn parse_scrape(text: &str) -> Scrape {
    const PASSES: &str = "nightshift_reconcile_duration_seconds";
    let mut scrape = Scrape::default();
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let Some((name, value)) = line.rsplit_once(' ') else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        let label = |prefix: &str| name.strip_prefix(prefix).and_then(|rest| rest.strip_suffix("\"}"));
        if let Some(le) = label(&format!("{PASSES}_bucket{{le=\"")) {
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::NAN) };
            scrape.passes.buckets.push((le, value));
        } else if name == format!("{PASSES}_sum") {
            scrape.passes.sum = value;
        } else if name == format!("{PASSES}_count") {
            scrape.passes.count = value;
        } else if let Some(reason) = label("nightshift_reconcile_errors_total{reason=\"") {
            scrape.errors.insert(reason.to_owned(), value);
        }
    }
    scrape
}
