//! Connections held by each client, bounded (`http.max_connections_per_client`), so that
//! one client cannot take every connection slot. A client is an IPv4 address, or an IPv6
//! /64 (one host's share of addresses; an IPv4 address carried in IPv6 counts as itself).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};

#[derive(Debug)]
pub struct ClientSlots {
    per_client: usize,
    held: Mutex<HashMap<IpAddr, usize>>,
}

impl ClientSlots {
    pub fn new(per_client: usize) -> Arc<Self> {
        Arc::new(Self { per_client, held: Mutex::default() })
    }

    /// A slot for a connection from `address`, or `None` when that client holds as many
    /// as it may.
    pub fn take(self: &Arc<Self>, address: IpAddr) -> Option<ClientSlot> {
        let client = client_of(address);
        let mut held = self.held.lock().expect("client slots");
        let count = held.entry(client).or_default();
        if *count >= self.per_client {
            return None;
        }
        *count += 1;
        Some(ClientSlot { slots: self.clone(), client })
    }

    #[cfg(test)]
    fn clients(&self) -> usize {
        self.held.lock().expect("client slots").len()
    }
}

/// A connection's slot; given back when dropped.
#[derive(Debug)]
pub struct ClientSlot {
    slots: Arc<ClientSlots>,
    client: IpAddr,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().expect("client slots");
        if let Some(count) = held.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.client);
            }
        }
    }
}

/// The client an address belongs to.
fn client_of(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V4(_) => address,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let [a, b, c, d, ..] = v6.segments();
                IpAddr::V6(Ipv6Addr::new(a, b, c, d, 0, 0, 0, 0))
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn a_client_holds_at_most_its_share_and_gets_slots_back() {
        let slots = ClientSlots::new(2);
        let first = slots.take(ip("10.0.0.1")).unwrap();
        let _second = slots.take(ip("10.0.0.1")).unwrap();
        assert!(slots.take(ip("10.0.0.1")).is_none(), "a third is refused");
        assert!(slots.take(ip("10.0.0.2")).is_some(), "another client is not");
        drop(first);
        assert!(slots.take(ip("10.0.0.1")).is_some(), "a slot given back is taken again");
    }

    #[test]
    fn an_ipv6_slash_64_is_one_client_and_mapped_ipv4_is_its_ipv4() {
        let slots = ClientSlots::new(1);
        let _one = slots.take(ip("2001:db8:1:2::1")).unwrap();
        assert!(slots.take(ip("2001:db8:1:2:ffff::9")).is_none(), "same /64");
        assert!(slots.take(ip("2001:db8:1:3::1")).is_some(), "another /64");
        let _v4 = slots.take(ip("192.0.2.7")).unwrap();
        assert!(slots.take(ip("::ffff:192.0.2.7")).is_none(), "the same IPv4 client");
    }

    #[test]
    fn clients_without_connections_are_forgotten() {
        let slots = ClientSlots::new(4);
        let held: Vec<_> = (0..100).map(|n| slots.take(ip(&format!("10.0.1.{n}"))).unwrap()).collect();
        assert_eq!(slots.clients(), 100);
        drop(held);
        assert_eq!(slots.clients(), 0);
    }
}
