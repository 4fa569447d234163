//! The cluster tier: the operator and the Helm chart on a real kube-apiserver, etcd and
//! kube-controller-manager, with a stand-in kubelet that runs each Pod's command here.

#[path = "../common/mod.rs"]
mod common;

mod applied;
mod capacity;
mod chart;
mod cluster_harness;
mod night_shift;
mod operator;
mod rules;
