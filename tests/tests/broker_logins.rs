//! The embedded broker with logins (`serve --embedded-broker … --broker-passwords FILE`):
//! a client without the right password cannot connect, and a device that can log in
//! cannot fill the job with made-up devices (1,000 hellos under ids the password file
//! does not list are ignored, so the job waits for its real devices), nor pose as another
//! device (a goodbye and hellos under dev-0's topic without dev-0's tag change nothing):
//! the round counts all three real devices.

mod common;

use std::time::{Duration, Instant};

use common::fake_device::FakeDevice;
use fedpo_transport::{BrokerUrl, LinkOptions, MqttLink, Topics};
use fedpo_wire::{DeviceBye, DeviceHello, Message};

const JOB: &str = "logins";

fn login(url: &BrokerUrl, user: &str, password: &str) -> BrokerUrl {
    BrokerUrl { username: Some(user.into()), password: Some(password.into()), ..url.clone() }
}

fn try_connect(url: &BrokerUrl, client: &str) -> Option<MqttLink> {
    let mut opts = LinkOptions::new(client);
    opts.connect_wait = Duration::from_secs(3);
    MqttLink::connect(url, &opts).ok()
}

#[test]
fn only_listed_logins_connect_and_neither_made_up_devices_nor_forged_hellos_and_goodbyes_count() {
    let dir = fedpo_tests::TestDir::new();
    let passwords = dir.path().join("passwords");
    std::fs::write(&passwords, "# the fleet\ndev-0:zero\ndev-1:one\ndev-2:two\n").unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = BrokerUrl::parse(&format!("mqtt://127.0.0.1:{port}")).unwrap();
    let out = dir.path().join("aggregator");
    let aggregator = {
        let args: Vec<String> = ["fedpo-aggregator", "serve", "--embedded-broker", &format!("127.0.0.1:{port}")]
            .into_iter()
            .chain(["--broker-passwords", passwords.to_str().unwrap(), "--job", JOB, "--out", out.to_str().unwrap()])
            .chain(["--freeze-embeddings", "--per-round", "3", "--min-devices", "3", "--batch-pairs", "4"])
            .chain(["--rounds", "1", "--local-steps", "1", "--no-final-eval", "--round-deadline", "60"])
            .map(String::from)
            .collect();
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let attacker = loop {
        if let Some(link) = try_connect(&login(&url, "dev-2", "two"), "dev-2-rogue") {
            break link;
        }
        assert!(Instant::now() < deadline, "the broker never let dev-2 in");
    };
    assert!(try_connect(&url, "anonymous").is_none(), "a client without a login connected");
    assert!(try_connect(&login(&url, "dev-0", "two"), "guesser").is_none(), "a wrong password connected");

    // A listed device's login, used to make up a thousand devices.
    let topics = Topics::new(JOB).unwrap();
    for k in 0..1000 {
        let id = format!("made-up-{k}");
        let hello = DeviceHello {
            device: id.clone(),
            pairs: 4,
            backend: "cpu".into(),
            memory_mb: 0,
            instance: 1,
            connection: 1,
            model: Vec::new(),
            tag: Vec::new(),
        };
        attacker.publish(&topics.up(&id), Message::Hello(hello).encode()).unwrap();
    }
    assert!(attacker.flush(Duration::from_secs(30)));
    std::thread::sleep(Duration::from_secs(1));
    assert!(!aggregator.is_finished(), "the job ended on made-up devices");

    // The real devices, each with its own login, join at once: the job needs all three.
    let devices: Vec<(FakeDevice, _)> = [("dev-0", "zero"), ("dev-1", "one"), ("dev-2", "two")]
        .map(|(id, password)| {
            let url = login(&url, id, password);
            std::thread::spawn(move || {
                let device = FakeDevice::join(&url, JOB, id);
                let plan = device.plan();
                (device, plan)
            })
        })
        .into_iter()
        .map(|joining| joining.join().unwrap())
        .collect();
    // dev-2's login, used to pose as dev-0: a goodbye, and hellos from two other
    // processes that would get dev-0 left out of the job as claimed twice.
    let mut forged_bye = DeviceBye::new("dev-0", "forged");
    fedpo_wire::device_tag::tag(&mut forged_bye, "two");
    attacker.publish(&topics.up("dev-0"), Message::Bye(forged_bye).encode()).unwrap();
    for instance in [0xa, 0xb, 0xa] {
        let hello = DeviceHello {
            device: "dev-0".into(),
            pairs: 4,
            backend: "cpu".into(),
            memory_mb: 0,
            instance,
            connection: 1,
            model: Vec::new(),
            tag: Vec::new(),
        };
        attacker.publish(&topics.up("dev-0"), Message::Hello(hello).encode()).unwrap();
    }
    assert!(attacker.flush(Duration::from_secs(30)));
    std::thread::sleep(Duration::from_secs(1));
    drop(attacker);
    for (device, plan) in &devices {
        device.send(plan, 1, 0.1, false);
    }
    aggregator.join().unwrap().expect("the aggregator finishes the job");

    let record = &common::metrics_records(&out)[0];
    assert_eq!(record["selected"], serde_json::json!(["dev-0", "dev-1", "dev-2"]), "{record}");
    assert_eq!(record["participants"], serde_json::json!(["dev-0", "dev-1", "dev-2"]), "{record}");
}
