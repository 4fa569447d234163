//! The node tier: the image built with podman, and the chart installed on a real node
//! (kube-scheduler, kubelet, kube-proxy, containerd) running it.

#[path = "../common/mod.rs"]
mod common;

mod image;
mod node;
