//! The embedded broker under traffic meant to fill it (finding 7 of the adversary
//! review): an aggregator hosting it (`serve --embedded-broker`) waits for its devices
//! while three clients
//! - flood the job's uplink with 1 MiB of garbage per message (400 MiB),
//! - flood topics nobody reads but a subscriber to `#` that never reads its socket
//!   (400 MiB),
//! - publish 200 retained 1 MiB messages.
//!
//! The aggregator process's peak RSS grows by no more than the broker's limits allow
//! (two client queues of one model transfer each, and a packet per connection), not
//! with the 1 GiB that went through; the reader that never reads is disconnected after
//! the stall limit, so the flood goes on; and nothing retained is handed to a client
//! that subscribes afterwards.

mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{binary, Wiretap};
use fedpo_transport::{BrokerUrl, LinkOptions, MqttLink, Topics};

const JOB: &str = "flood";
const MIB: usize = 1 << 20;

fn remaining_length(mut len: usize, out: &mut Vec<u8>) {
    loop {
        let byte = (len % 128) as u8;
        len /= 128;
        out.push(if len > 0 { byte | 0x80 } else { byte });
        if len == 0 {
            return;
        }
    }
}

fn string(s: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A raw MQTT 3.1.1 client: CONNECT with a clean session and a 60 s keep-alive, longer
/// than the test, so that only what it does (not its silence) ends it.
fn raw_client(addr: SocketAddr, client_id: &str) -> TcpStream {
    let mut body = Vec::new();
    string("MQTT", &mut body);
    body.extend_from_slice(&[4, 0x02, 0, 60]);
    string(client_id, &mut body);
    let mut packet = vec![0x10];
    remaining_length(body.len(), &mut packet);
    packet.extend_from_slice(&body);
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.write_all(&packet).unwrap();
    stream
}

fn subscribe(stream: &mut TcpStream, filter: &str) {
    let mut body = vec![0, 1];
    string(filter, &mut body);
    body.push(1);
    let mut packet = vec![0x82];
    remaining_length(body.len(), &mut packet);
    packet.extend_from_slice(&body);
    stream.write_all(&packet).unwrap();
}

fn publish_retained(stream: &mut TcpStream, topic: &str, payload: &[u8]) -> std::io::Result<()> {
    let mut packet = vec![0x31];
    remaining_length(2 + topic.len() + payload.len(), &mut packet);
    string(topic, &mut packet);
    stream.write_all(&packet)?;
    stream.write_all(payload)
}

fn rss_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':')?.trim().strip_suffix("kB")?.trim().parse().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

#[test]
fn a_flood_retained_messages_and_a_reader_that_never_reads_leave_the_embedded_broker_within_its_limits() {
    let dir = fedpo_tests::TestDir::new();
    let addr: SocketAddr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let url = BrokerUrl::parse(&format!("mqtt://{addr}")).unwrap();
    let out = dir.path().join("aggregator");
    let mut aggregator = Command::new(binary("fedpo-aggregator"))
        .args(["serve", "--embedded-broker", &addr.to_string(), "--job", JOB, "--freeze-embeddings"])
        .args(["--min-devices", "3", "--per-round", "3", "--rounds", "1", "--register-timeout", "600"])
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("aggregator.log")).unwrap())
        .spawn()
        .unwrap();
    let pid = aggregator.id();
    let kill = scopeguard(move || {
        let _ = Command::new("kill").arg(pid.to_string()).status();
    });

    // The aggregator is up once its first checkpoint is written: model built, broker
    // sized for its transfers.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !out.join("checkpoint").join("state.cbor").exists() {
        assert!(Instant::now() < deadline, "the aggregator never started");
        assert!(aggregator.try_wait().unwrap().is_none(), "the aggregator exited");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(1));
    let baseline = rss_mib(pid, "VmRSS");

    let peak = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                peak.fetch_max(rss_mib(pid, "VmRSS") as u64, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };

    let mut never_reads = raw_client(addr, "never-reads");
    subscribe(&mut never_reads, "#");
    std::thread::sleep(Duration::from_millis(200));

    let garbage = vec![0xa5u8; MIB];
    let flooders: Vec<_> = [("uplink", true), ("junk", false)]
        .into_iter()
        .map(|(name, uplink)| {
            let (url, garbage) = (url.clone(), garbage.clone());
            std::thread::spawn(move || {
                let link = MqttLink::connect(&url, &LinkOptions::new(name)).unwrap();
                let topics = Topics::new(JOB).unwrap();
                for k in 0..400 {
                    let topic = if uplink { topics.up(&format!("ghost-{}", k % 20)) } else { format!("junk/{k}") };
                    link.publish(&topic, garbage.clone()).unwrap();
                }
                assert!(link.flush(Duration::from_secs(120)), "{name}: the broker stopped taking publishes");
            })
        })
        .collect();
    let retainer = std::thread::spawn({
        let garbage = garbage.clone();
        move || {
            let mut stream = raw_client(addr, "retainer");
            for k in 0..200 {
                publish_retained(&mut stream, &format!("kept/{k}"), &garbage).unwrap();
            }
            stream
        }
    });
    for f in flooders {
        f.join().unwrap();
    }
    let _retainer = retainer.join().unwrap();
    std::thread::sleep(Duration::from_secs(2));
    done.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    let peak = peak.load(Ordering::SeqCst) as f64;
    let after = rss_mib(pid, "VmRSS");
    eprintln!("aggregator RSS: {baseline:.0} MiB before, {peak:.0} MiB at peak, {after:.0} MiB after 1 GiB of traffic");

    // The limits: two queues (the reader that never reads, and the aggregator's own)
    // of one transfer each (the tiny model, 28 MB, plus a packet), and a packet per
    // flooding connection; the rest is allocator slack.
    assert!(peak - baseline < 160.0, "peak RSS grew by {:.0} MiB", peak - baseline);

    // Nothing retained is waiting for the next subscriber.
    let late = Wiretap::start(&url, "kept/#");
    std::thread::sleep(Duration::from_secs(1));
    assert!(late.stop().is_empty(), "a retained message was stored and handed out");

    // The silent reader was cut off; the aggregator is still waiting for its devices.
    never_reads.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let closed = std::io::Read::read_to_end(&mut never_reads, &mut Vec::new());
    assert!(closed.is_ok(), "the reader that never reads is still connected: {closed:?}");
    assert!(aggregator.try_wait().unwrap().is_none(), "the aggregator exited under the flood");
    drop(kill);
}

/// Runs `f` when dropped, so that a failing assertion still stops the aggregator.
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}
