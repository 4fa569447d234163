//! Ports for the servers a test starts that cannot pick their own and say which they got
//! (etcd, the kube-* components, s3s-fs, a container's published port).
//!
//! "Bind port 0, read the number, close, hand the number over" races with everything
//! else that binds port 0 meanwhile. Instead, ports come from just below the kernel's
//! ephemeral range (`ip_local_port_range`), where port 0 binds and outgoing connections
//! never land, and each is claimed across test processes by an exclusive lock on a file
//! named after it, held until the claiming process exits (the kernel drops it then,
//! whatever way the process ends).

use std::fs::{File, OpenOptions};
use std::net::TcpListener;
use std::sync::Mutex;

/// How many ports below the ephemeral range tests may claim.
const SPAN: u16 = 8000;

/// Locks held for the life of this process: the ports it claimed.
static CLAIMED: Mutex<Vec<File>> = Mutex::new(Vec::new());

fn ephemeral_start() -> u16 {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    range.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(32768)
}

/// `N` ports no other test process holds and nothing listens on (on any address).
pub fn claim<const N: usize>() -> [u16; N] {
    let dir = std::env::temp_dir().join("nightshift-ports");
    std::fs::create_dir_all(&dir).unwrap();
    let end = ephemeral_start();
    let start = end.saturating_sub(SPAN).max(1024);
    // Start where this process's id points, so that parallel test processes rarely
    // contend for the same locks.
    let offset = (std::process::id() as u16).wrapping_mul(97) % (end - start);
    let mut ports = Vec::with_capacity(N);
    let mut claimed = CLAIMED.lock().unwrap();
    for step in 0..(end - start) {
        if ports.len() == N {
            break;
        }
        let port = start + (offset + step) % (end - start);
        let file = OpenOptions::new().create(true).truncate(false).write(true).open(dir.join(port.to_string()));
        let Ok(file) = file else { continue };
        if file.try_lock().is_err() || TcpListener::bind(("0.0.0.0", port)).is_err() {
            continue;
        }
        claimed.push(file);
        ports.push(port);
    }
    ports.try_into().unwrap_or_else(|_| panic!("no {N} free ports in {start}..{end}"))
}

pub fn claim_one() -> u16 {
    let [port] = claim();
    port
}
