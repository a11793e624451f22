//! Signed plans and results.
//!
//! The aggregator signs every plan and every round result it publishes with an Ed25519
//! key; a device that pins the matching public key (`fedpo-device run --trust-key`) trains
//! only on plans, and ends only on results, whose signature verifies. The plan names the
//! digest of the global model and of every section, and devices check each transfer
//! against those digests, so one signature covers the model too. Both name the job and
//! the run they belong to, so that a device can refuse what was signed for another job or
//! an earlier run of the same one, as TUF and Uptane bind their metadata to a repository
//! and a version. The signed bytes are the message's CBOR with an empty signature, behind
//! a domain tag per kind, so a signature can never be replayed as anything else.

use std::path::Path;

use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::PrivatePkcs8KeyDer;
use thiserror::Error;

use crate::message::{RoundPlan, RoundResult};

/// Why a message or a key was refused.
#[derive(Debug, Error, PartialEq)]
pub enum SignatureError {
    /// The message carries no signature.
    #[error("round {round}: the {kind} is not signed")]
    Unsigned {
        /// `plan` or `result`.
        kind: &'static str,
        /// The message's round.
        round: u64,
    },
    /// The signature does not match the message and the pinned key.
    #[error(
        "round {round}: the {kind}'s signature does not verify with the trusted key (tampered, or signed by another key)"
    )]
    Invalid {
        /// `plan` or `result`.
        kind: &'static str,
        /// The message's round.
        round: u64,
    },
    /// A key file or string that cannot be used.
    #[error("{0}")]
    Key(String),
}

/// A message the aggregator signs. Sealed: only fedpo's own kinds, each with its domain.
pub trait Signed: Clone + serde::Serialize + sealed::Sealed {
    /// Prefix of the signed bytes, one per kind.
    const DOMAIN: &'static [u8];
    /// The kind, for errors and logs.
    const KIND: &'static str;
    /// The round the message is about.
    fn round(&self) -> u64;
    /// The signature field.
    fn signature_mut(&mut self) -> &mut Vec<u8>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::message::RoundPlan {}
    impl Sealed for crate::message::RoundResult {}
}

impl Signed for RoundPlan {
    const DOMAIN: &'static [u8] = b"fedpo round plan v1\0";
    const KIND: &'static str = "plan";
    fn round(&self) -> u64 {
        self.round
    }
    fn signature_mut(&mut self) -> &mut Vec<u8> {
        &mut self.signature
    }
}

impl Signed for RoundResult {
    const DOMAIN: &'static [u8] = b"fedpo round result v1\0";
    const KIND: &'static str = "result";
    fn round(&self) -> u64 {
        self.round
    }
    fn signature_mut(&mut self) -> &mut Vec<u8> {
        &mut self.signature
    }
}

/// The message's signature, and the bytes it signs.
fn split<M: Signed>(message: &M) -> (Vec<u8>, Vec<u8>) {
    let mut unsigned = message.clone();
    let signature = std::mem::take(unsigned.signature_mut());
    let mut bytes = M::DOMAIN.to_vec();
    bytes.extend(serde_cbor::to_vec(&unsigned).expect("a message always encodes"));
    (signature, bytes)
}

/// The aggregator's signing key.
pub struct Signer {
    key: Ed25519KeyPair,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Signer({})", self.public_key_hex())
    }
}

impl Signer {
    /// Reads a PEM PKCS#8 Ed25519 private key, as `openssl genpkey -algorithm ed25519` or
    /// `security/make-certs.sh` writes it.
    pub fn from_pem_file(path: &Path) -> Result<Self, SignatureError> {
        let pem = std::fs::read(path).map_err(|e| SignatureError::Key(format!("reading {}: {e}", path.display())))?;
        let der = PrivatePkcs8KeyDer::from_pem_slice(&pem)
            .map_err(|e| SignatureError::Key(format!("{}: not a PEM PKCS#8 private key ({e:?})", path.display())))?;
        let key = Ed25519KeyPair::from_pkcs8_maybe_unchecked(der.secret_pkcs8_der())
            .map_err(|e| SignatureError::Key(format!("{}: not an Ed25519 key ({e})", path.display())))?;
        Ok(Self { key })
    }

    /// The public key devices pin, as 64 hex digits.
    pub fn public_key_hex(&self) -> String {
        hex::encode(self.key.public_key().as_ref())
    }

    /// Signs `message` in place (replacing any signature it had).
    pub fn sign<M: Signed>(&self, message: &mut M) {
        let (_, bytes) = split(message);
        *message.signature_mut() = self.key.sign(&bytes).as_ref().to_vec();
    }
}

/// A device's pinned aggregator key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustedKey {
    key: [u8; 32],
}

impl TrustedKey {
    /// From 64 hex digits, or a file holding them.
    pub fn parse(hex_or_file: &str) -> Result<Self, SignatureError> {
        let text = match std::fs::read_to_string(hex_or_file) {
            Ok(contents) => contents,
            Err(_) => hex_or_file.to_string(),
        };
        let bytes = hex::decode(text.trim()).map_err(|_| {
            SignatureError::Key(format!("trusted key `{hex_or_file}`: expected 64 hex digits or a file holding them"))
        })?;
        let key: [u8; 32] = bytes.try_into().map_err(|b: Vec<u8>| {
            SignatureError::Key(format!("trusted key `{hex_or_file}`: {} bytes, an Ed25519 public key has 32", b.len()))
        })?;
        Ok(Self { key })
    }

    /// Checks `message`'s signature.
    pub fn verify<M: Signed>(&self, message: &M) -> Result<(), SignatureError> {
        let (signature, bytes) = split(message);
        if signature.is_empty() {
            return Err(SignatureError::Unsigned { kind: M::KIND, round: message.round() });
        }
        UnparsedPublicKey::new(&ED25519, self.key)
            .verify(&bytes, &signature)
            .map_err(|_| SignatureError::Invalid { kind: M::KIND, round: message.round() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Hyperparameters;
    use crate::split_payload;
    use crate::wire_tensor::TensorPayload;

    /// A throwaway key made with `openssl genpkey -algorithm ed25519`, and its public key
    /// as openssl prints it (`openssl pkey -pubout -outform DER | tail -c 32`).
    const OPENSSL_KEY: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIIcSE7MhiSE7IWxuP8sbDD87cpHdl64u81Gdu9NQyFIE
-----END PRIVATE KEY-----
";
    const OPENSSL_PUBLIC: &str = "86097512ece3402cf85900ab608bad73f57143416597c16a5aa4374c090cb58c";

    fn signer(dir: &Path, name: &str) -> Signer {
        let path = dir.join(name);
        std::fs::write(&path, OPENSSL_KEY).unwrap();
        Signer::from_pem_file(&path).unwrap()
    }

    fn random_signer() -> Signer {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&ring::rand::SystemRandom::new()).unwrap();
        Signer { key: Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap() }
    }

    fn plan() -> RoundPlan {
        let (manifest, _) = split_payload("r1", &TensorPayload { tensors: Vec::new() }, 1 << 20);
        RoundPlan {
            round: 1,
            selected: vec!["pi-7".into()],
            hyper: Hyperparameters { method: "pfeddpo".into(), local_steps: 2, lr: 0.1, beta: 0.2, batch_pairs: 8 },
            strategy: Default::default(),
            model_spec: "{}".into(),
            global_model: manifest,
            sections: Default::default(),
            signature: Vec::new(),
            secagg: None,
            update_codec: Default::default(),
            downlink: None,
            sender_epoch: 7,
            job: "lab".into(),
            run: 42,
        }
    }

    #[test]
    fn a_signed_plan_verifies_and_any_change_to_it_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let s = signer(dir.path(), "agg.key");
        assert_eq!(s.public_key_hex(), OPENSSL_PUBLIC, "the same public key as openssl derives");
        let verifier = TrustedKey::parse(&s.public_key_hex()).unwrap();
        let mut p = plan();
        assert_eq!(verifier.verify(&p), Err(SignatureError::Unsigned { kind: "plan", round: 1 }));
        s.sign(&mut p);
        assert_eq!(verifier.verify(&p), Ok(()));

        let mut tampered = p.clone();
        tampered.global_model.digest[0] ^= 1; // another model
        assert_eq!(verifier.verify(&tampered), Err(SignatureError::Invalid { kind: "plan", round: 1 }));
        let mut tampered = p.clone();
        tampered.hyper.lr = 10.0;
        assert_eq!(verifier.verify(&tampered), Err(SignatureError::Invalid { kind: "plan", round: 1 }));
        let mut tampered = p.clone();
        tampered.run += 1; // the same plan in another run
        assert_eq!(verifier.verify(&tampered), Err(SignatureError::Invalid { kind: "plan", round: 1 }));
        let mut tampered = p.clone();
        tampered.job = "other".into();
        assert_eq!(verifier.verify(&tampered), Err(SignatureError::Invalid { kind: "plan", round: 1 }));
        let mut tampered = p.clone();
        tampered.selected.push("pi-8".into());
        assert_eq!(verifier.verify(&tampered), Err(SignatureError::Invalid { kind: "plan", round: 1 }));

        // A plan signed by another key does not verify either.
        let other = random_signer();
        let mut forged = plan();
        other.sign(&mut forged);
        assert_eq!(verifier.verify(&forged), Err(SignatureError::Invalid { kind: "plan", round: 1 }));
    }

    #[test]
    fn a_signed_result_verifies_and_a_plan_signature_never_passes_for_a_result() {
        let dir = tempfile::tempdir().unwrap();
        let s = signer(dir.path(), "agg.key");
        let verifier = TrustedKey::parse(&s.public_key_hex()).unwrap();
        let mut result = RoundResult {
            round: 3,
            participants: vec!["pi-7".into()],
            train_loss: 0.5,
            global_digest: vec![7; 32],
            finished: true,
            job: "lab".into(),
            run: 42,
            signature: Vec::new(),
        };
        assert_eq!(verifier.verify(&result), Err(SignatureError::Unsigned { kind: "result", round: 3 }));
        s.sign(&mut result);
        assert_eq!(verifier.verify(&result), Ok(()));
        let mut other_run = result.clone();
        other_run.run = 41;
        assert_eq!(verifier.verify(&other_run), Err(SignatureError::Invalid { kind: "result", round: 3 }));

        // The domain tags keep one kind's signature from passing for another's bytes.
        let mut p = plan();
        s.sign(&mut p);
        let mut dressed = result.clone();
        dressed.signature = p.signature.clone();
        assert_eq!(verifier.verify(&dressed), Err(SignatureError::Invalid { kind: "result", round: 3 }));
    }

    #[test]
    fn trusted_keys_parse_from_hex_or_a_file_and_bad_ones_say_why() {
        let dir = tempfile::tempdir().unwrap();
        let s = signer(dir.path(), "agg.key");
        let file = dir.path().join("agg.pub");
        std::fs::write(&file, format!("{}\n", s.public_key_hex())).unwrap();
        assert_eq!(TrustedKey::parse(file.to_str().unwrap()), TrustedKey::parse(&s.public_key_hex()));
        let short = TrustedKey::parse("abcd").unwrap_err().to_string();
        assert!(short.contains("2 bytes, an Ed25519 public key has 32"), "{short}");
        let junk = TrustedKey::parse("not-hex").unwrap_err().to_string();
        assert!(junk.contains("64 hex digits"), "{junk}");
        let bad_pem = dir.path().join("bad.key");
        std::fs::write(&bad_pem, "hello").unwrap();
        let e = Signer::from_pem_file(&bad_pem).unwrap_err().to_string();
        assert!(e.contains("bad.key") && e.contains("PEM"), "{e}");
    }
}
