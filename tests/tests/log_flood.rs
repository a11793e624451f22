//! A client floods the aggregator with 10,000 undecodable messages under one device's
//! topic. Each one would be worth a warning; together they would bury the log. The
//! aggregator writes the first, holds back the rest for its interval, and says how many it
//! held back.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::binary;
use fedpo_transport::{EmbeddedBroker, LinkOptions, MqttLink, Topics};

#[test]
fn ten_thousand_bad_messages_from_one_device_write_a_handful_of_warnings() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let log = dir.path().join("aggregator.log");
    let mut aggregator = Command::new(binary("fedpo-aggregator"))
        .args(["serve", "--broker", &url.to_string(), "--job", "flood", "--min-devices", "3"])
        .args(["--register-timeout", "60", "--out"])
        .arg(dir.path().join("out"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let flooder = MqttLink::connect(&url, &LinkOptions::new("flooder")).unwrap();
    let topic = Topics::new("flood").unwrap().up("dev-x");
    // Once the aggregator listens, its first warning appears.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&log).unwrap().contains("undecodable") {
        assert!(Instant::now() < deadline, "the aggregator never warned: {}", std::fs::read_to_string(&log).unwrap());
        flooder.publish(&topic, b"\xff garbage".to_vec()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..10_000 {
        flooder.publish(&topic, b"\xff garbage".to_vec()).unwrap();
    }
    assert!(flooder.flush(Duration::from_secs(60)));
    std::thread::sleep(Duration::from_secs(2));
    aggregator.kill().unwrap();
    aggregator.wait().unwrap();

    let text = std::fs::read_to_string(&log).unwrap();
    let warnings = text.lines().filter(|l| l.contains("undecodable")).count();
    assert!((1..=3).contains(&warnings), "{warnings} warning lines for one flood:\n{}", &text[..text.len().min(2000)]);
}
