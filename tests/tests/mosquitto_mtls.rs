//! A fleet through a real Mosquitto with the mutual-TLS listener and ACL shipped in
//! `security/`: every client authenticates with its own certificate, the job completes,
//! and a device that publishes as another device (or as the aggregator) is refused by the
//! broker, so nothing it sent reaches the aggregator.
//!
//! Needs Debian's `mosquitto` and `openssl` (`.ci/run` installs them).

mod common;

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use common::Wiretap;
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_device::participant::{self, ParticipantConfig};
use fedpo_transport::{BrokerUrl, LinkOptions, MqttLink, TlsFiles, Topics};

fn security_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../security")
}

/// A Mosquitto process on a free loopback port, killed on drop.
struct Mosquitto {
    child: Child,
    port: u16,
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Mosquitto {
    /// Makes the fleet's certificates in `dir` and starts the shipped configuration there.
    fn start(dir: &Path, devices: &[&str]) -> Self {
        let made = Command::new("bash")
            .arg(security_dir().join("make-certs.sh"))
            .arg(dir)
            .args(devices)
            .output()
            .expect("make-certs.sh runs");
        assert!(made.status.success(), "make-certs.sh: {}", String::from_utf8_lossy(&made.stderr));
        std::fs::copy(security_dir().join("acl"), dir.join("acl")).unwrap();
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let conf = std::fs::read_to_string(security_dir().join("mosquitto.conf"))
            .unwrap()
            .replace("listener 8883 127.0.0.1", &format!("listener {port} 127.0.0.1"))
            // Started as root, mosquitto would switch to its own user, which cannot read
            // the test's keys; as any other user this line has no effect.
            + "user root\n";
        std::fs::write(dir.join("mosquitto.conf"), conf).unwrap();
        let child = Command::new(common::mosquitto_binary())
            .args(["-c", "mosquitto.conf"])
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("mosquitto.log")).unwrap())
            .spawn()
            .expect("mosquitto starts");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "mosquitto did not listen on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { child, port }
    }

    fn url(&self) -> BrokerUrl {
        BrokerUrl::parse(&format!("mqtts://localhost:{}", self.port)).unwrap()
    }
}

fn tls(dir: &Path, identity: &str) -> TlsFiles {
    TlsFiles {
        ca: Some(dir.join("ca.pem")),
        cert: Some(dir.join(format!("{identity}.pem"))),
        key: Some(dir.join(format!("{identity}.key"))),
    }
}

fn options(client_id: &str, dir: &Path, identity: &str) -> LinkOptions {
    let mut opts = LinkOptions::new(client_id);
    opts.tls = tls(dir, identity);
    opts
}

#[test]
fn fleet_runs_through_mosquitto_with_mtls_and_a_device_cannot_publish_as_another() {
    let dir = fedpo_tests::TestDir::new();
    let certs = dir.path().join("certs");
    let devices = ["dev-0", "dev-1", "dev-2"];
    let broker = Mosquitto::start(&certs, &devices);
    let url = broker.url();
    let topics = Topics::new("mtls").unwrap();
    // The tap holds the aggregator's identity: it hears everything the aggregator could.
    let tap = Wiretap::start_with(&url, "fedpo/mtls/#", &options("wiretap", &certs, "aggregator"));

    let out = dir.path().join("aggregator");
    let aggregator = {
        let mut args = common::serve_args(&url, "mtls", &out, &["--rounds", "2", "--local-steps", "1"]);
        for (flag, file) in [("--ca", "ca.pem"), ("--cert", "aggregator.pem"), ("--key", "aggregator.key")] {
            args.extend([flag.to_string(), certs.join(file).display().to_string()]);
        }
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };

    // Without a client certificate, the broker refuses the connection.
    let mut anonymous = LinkOptions::new("anonymous");
    anonymous.tls = TlsFiles { ca: Some(certs.join("ca.pem")), cert: None, key: None };
    anonymous.connect_wait = Duration::from_secs(3);
    assert!(MqttLink::connect(&url, &anonymous).is_err(), "a client without a certificate connected");

    // dev-2's certificate, used to impersonate dev-0 and the aggregator.
    let rogue = MqttLink::connect(&url, &options("rogue", &certs, "dev-2")).expect("dev-2's certificate connects");
    let forged_update = b"forged by dev-2 as dev-0".to_vec();
    let forged_plan = b"forged by dev-2 as the aggregator".to_vec();
    let own_topic = b"dev-2 on its own topic".to_vec();
    let forge = || {
        rogue.publish(&topics.up("dev-0"), forged_update.clone()).unwrap();
        rogue.publish(&topics.down(), forged_plan.clone()).unwrap();
    };
    forge();
    // Before any round: garbage from dev-2 during a round would cost dev-2 that round.
    rogue.publish(&topics.up("dev-2"), own_topic.clone()).unwrap();

    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 4, heldout_pairs: 4, seed: 0 };
    let handles: Vec<_> = devices
        .iter()
        .enumerate()
        .map(|(k, id)| {
            let data = generate_device(&spec, k).unwrap();
            let cfg = ParticipantConfig {
                vocab: None,
                broker: url.clone(),
                tls: tls(&certs, id),
                job: "mtls".into(),
                id: id.to_string(),
                state_dir: dir.path().join(id),
                train: data.train,
                heldout: data.heldout,
                max_len: 48,
                compute: Device::Cpu,
                max_memory_mib: None,
                max_micro_batch_pairs: None,
                start_on_disk: false,
                compute_dtype: candle_core::DType::F32,
                trusted_key: None,
                rejoin: false,
                reset_adapter: false,
                alone_in_process: false,
                training_slots: None,
                rewrite_update: None,
                stop: Arc::new(AtomicBool::new(false)),
            };
            std::thread::spawn(move || participant::run(cfg).expect("device runs to the end of the job"))
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    forge(); // again while rounds run
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    handles.into_iter().for_each(|h| {
        h.join().unwrap();
    });
    let heard = tap.stop();

    let heard_payload = |p: &[u8]| heard.iter().any(|d| d.payload == p);
    assert!(heard_payload(&own_topic), "the tap hears dev-2 on its own topic (the rogue link works)");
    assert!(!heard_payload(&forged_update), "the broker let dev-2 publish as dev-0");
    assert!(!heard_payload(&forged_plan), "the broker let dev-2 publish on the aggregator's topic");

    let records = common::metrics_records(&out);
    let training: Vec<&serde_json::Value> = records.iter().filter(|r| r["evaluation"] == false).collect();
    assert_eq!(training.len(), 2, "both rounds ran");
    for r in training {
        assert_eq!(
            r["participants"],
            serde_json::json!(devices),
            "round {}: every device's update counted",
            r["round"]
        );
        assert!(r["rejected"].as_object().unwrap().is_empty(), "{}", r["rejected"]);
    }
}
