//! Where a webhook may go: `http` or `https` only, and, unless its host is allowed by
//! configuration, never to loopback, private, link-local or otherwise internal addresses
//! (a webhook URL is user input, and the server sits inside the cluster: SSRF). The
//! host is resolved once per attempt and the connection pinned to the checked addresses,
//! so a name cannot resolve to a public address for the check and a private one after.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use reqwest::Url;

/// Checks a configured URL: absolute, `http` or `https`, with a host, no credentials.
pub fn parse_url(raw: &str) -> Result<Url, String> {
    let url = Url::parse(raw).map_err(|error| format!("{raw:?} is not a URL: {error}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("{raw:?}: a webhook URL is http or https, not {}", url.scheme()));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{raw:?}: a webhook URL needs a host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!("{raw:?}: a webhook URL may not carry credentials"));
    }
    Ok(url)
}

/// Whether an address is internal: what a webhook may not reach unless allowed.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                // Shared address space (carrier-grade NAT), and 192.0.0.0/24.
                || (a == 100 && (64..128).contains(&b))
                || (a == 192 && b == 0 && v4.octets()[2] == 0)
                // Benchmarking (198.18.0.0/15) and reserved (240.0.0.0/4).
                || (a == 198 && (18..20).contains(&b))
                || a >= 240
        }
        IpAddr::V6(v6) => {
            let segments = v6.segments();
            let first = segments[0];
            // A Teredo address names its server's IPv4 address too.
            let teredo_server = first == 0x2001 && segments[1] == 0 && {
                let server = Ipv4Addr::from((u32::from(segments[2]) << 16) | u32::from(segments[3]));
                is_internal(IpAddr::V4(server))
            };
            if let Some(v4) = carried_ipv4(v6) {
                return teredo_server || is_internal(IpAddr::V4(v4));
            }
            // RFC 8215's local-use NAT64 prefix: its translator is the network's own, and
            // where the IPv4 address sits in it depends on the prefix length chosen.
            let local_nat64 = segments[..3] == [0x64, 0xff9b, 1];
            local_nat64
                || v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                // Unique local (fc00::/7) and link-local (fe80::/10).
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
        }
    }
}

/// The IPv4 address an IPv6 address carries, where the network may deliver it to that
/// IPv4 host: mapped (`::ffff:a.b.c.d`), compatible (`::a.b.c.d`), NAT64 (64:ff9b::/96
/// and the local-use 64:ff9b:1::/48, internal as a whole), 6to4 (2002:AABB:CCDD::/16) and Teredo (2001::/32,
/// the client's address inverted in the last 32 bits). Such an address is as internal as
/// the IPv4 address it carries.
fn carried_ipv4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    let v4 = |high: u16, low: u16| Ipv4Addr::from((u32::from(high) << 16) | u32::from(low));
    match s {
        [0, 0, 0, 0, 0, 0xffff, high, low] => Some(v4(high, low)),
        // `::` and `::1` are judged as IPv6 (unspecified and loopback).
        [0, 0, 0, 0, 0, 0, high, low] if (high, low) > (0, 1) => Some(v4(high, low)),
        [0x64, 0xff9b, 0, 0, 0, 0, high, low] => Some(v4(high, low)),
        [0x2002, high, low, ..] => Some(v4(high, low)),
        [0x2001, 0, ..] => Some(v4(!s[6], !s[7])),
        _ => None,
    }
}

/// Why an attempt was not made.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("cannot resolve {host}: {reason}")]
    Unresolved { host: String, reason: String },
    #[error("{host} resolves to {ip}, an internal address; list the host in webhooks.allowed_hosts to allow it")]
    Internal { host: String, ip: IpAddr },
}

/// The addresses to connect to for `url`, all checked.
pub async fn resolve(url: &Url, allowed_hosts: &[String]) -> Result<Vec<SocketAddr>, TargetError> {
    let host = url.host_str().unwrap_or_default().trim_start_matches('[').trim_end_matches(']').to_owned();
    let port = url.port_or_known_default().unwrap_or(443);
    let unresolved = |reason: String| TargetError::Unresolved { host: host.clone(), reason };
    let addresses: Vec<SocketAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => tokio::net::lookup_host((host.as_str(), port))
            .await
            .map_err(|error| unresolved(error.to_string()))?
            .collect(),
    };
    if addresses.is_empty() {
        return Err(unresolved("no addresses".into()));
    }
    let allowed = allowed_hosts.iter().any(|allowed| allowed.eq_ignore_ascii_case(&host));
    if !allowed && let Some(internal) = addresses.iter().find(|address| is_internal(address.ip())) {
        return Err(TargetError::Internal { host, ip: internal.ip() });
    }
    Ok(addresses)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_addresses_are_refused_and_public_ones_pass() {
        for internal in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "198.18.0.1",
            "240.0.0.1",
            // IPv4 carried in IPv6: compatible, NAT64, local-use NAT64, 6to4, Teredo.
            "::127.0.0.1",
            "::10.0.0.1",
            "64:ff9b::127.0.0.1",
            "64:ff9b::169.254.169.254",
            "64:ff9b::10.1.2.3",
            "64:ff9b:1::8.8.8.8",
            "2002:7f00:1::",
            "2002:a9fe:a9fe::1",
            "2002:c0a8:101:5::1",
            // Teredo: client 127.0.0.1 (inverted: 80ff:fffe), or a server at 10.0.0.1.
            "2001:0:4136:e378:8000:63bf:80ff:fffe",
            "2001:0:a00:1:8000:63bf:f7f7:f7f7",
        ] {
            assert!(is_internal(internal.parse().unwrap()), "{internal}");
        }
        for public in [
            "1.1.1.1",
            "8.8.8.8",
            "93.184.216.34",
            "100.128.0.1",
            "2606:4700::1111",
            "172.32.0.1",
            "::8.8.8.8",
            "64:ff9b::8.8.8.8",
            "2002:808:808::1",
            // Teredo: server 65.54.227.120, client 8.8.8.8 (inverted: f7f7:f7f7).
            "2001:0:4136:e378:8000:63bf:f7f7:f7f7",
        ] {
            assert!(!is_internal(public.parse().unwrap()), "{public}");
        }
    }

    #[test]
    fn only_http_urls_with_a_host_and_no_credentials_are_webhooks() {
        assert!(parse_url("https://hooks.example.com/nightshift?x=1").is_ok());
        assert!(parse_url("http://127.0.0.1:9000/hook").is_ok());
        for bad in [
            "ftp://example.com/",
            "file:///etc/passwd",
            "example.com/hook",
            "https://user:pw@example.com/",
            "javascript:alert(1)",
            "",
        ] {
            assert!(parse_url(bad).is_err(), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn a_host_resolving_to_an_internal_address_is_refused_unless_allowed() {
        let url = parse_url("http://127.0.0.1:9/hook").unwrap();
        assert!(matches!(resolve(&url, &[]).await, Err(TargetError::Internal { .. })));
        assert_eq!(resolve(&url, &["127.0.0.1".into()]).await.unwrap(), vec!["127.0.0.1:9".parse().unwrap()]);
        let named = parse_url("http://localhost:9/hook").unwrap();
        assert!(matches!(resolve(&named, &[]).await, Err(TargetError::Internal { .. })));
        let v6 = parse_url("http://[::1]:9/").unwrap();
        assert!(matches!(resolve(&v6, &[]).await, Err(TargetError::Internal { .. })));
        assert!(resolve(&v6, &["::1".into()]).await.is_ok());
        for disguised in [
            "http://[::127.0.0.1]/",
            "http://[64:ff9b::127.0.0.1]/",
            "http://[2002:7f00:1::]/",
            "http://[64:ff9b::169.254.169.254]/",
        ] {
            let url = parse_url(disguised).unwrap();
            assert!(matches!(resolve(&url, &[]).await, Err(TargetError::Internal { .. })), "{disguised}");
        }
    }
}
