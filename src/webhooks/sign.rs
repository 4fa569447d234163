//! Standard Webhooks signatures: `webhook-signature: v1,<base64 HMAC-SHA256>` of
//! `<webhook-id>.<webhook-timestamp>.<body>`, keyed by the secret's bytes (`whsec_` then
//! base64), which is what OpenAI's SDKs verify.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// A signing secret, `whsec_<base64>`.
#[derive(Clone, PartialEq, Eq)]
pub struct SigningSecret(Vec<u8>);

impl std::fmt::Debug for SigningSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SigningSecret(…)")
    }
}

impl SigningSecret {
    /// `whsec_` followed by the base64 of at least 16 bytes.
    pub fn parse(raw: &str) -> Option<Self> {
        let bytes = STANDARD.decode(raw.trim().strip_prefix("whsec_")?).ok()?;
        (bytes.len() >= 16).then_some(Self(bytes))
    }
}

/// The `webhook-signature` header of `body` sent as `id` at `timestamp`.
pub fn signature(secret: &SigningSecret, id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(&secret.0).expect("HMAC takes keys of any length");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_the_standard_webhooks_test_vector() {
        let secret = SigningSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let signed = signature(&secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, br#"{"test": 2432232314}"#);
        assert_eq!(signed, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn secrets_are_whsec_and_base64_of_enough_bytes() {
        for bad in ["", "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_", "whsec_not base64!", "whsec_c2hvcnQ="] {
            assert!(SigningSecret::parse(bad).is_none(), "{bad:?}");
        }
        assert_eq!(
            format!("{:?}", SigningSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap()),
            "SigningSecret(…)"
        );
    }
}
