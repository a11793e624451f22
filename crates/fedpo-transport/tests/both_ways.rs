//! Two clients streaming large transfers to each other at once, as an aggregator that
//! publishes the model while updates arrive, or a device that resends its update while the
//! model reaches it. rumqttc and rumqttd each stop reading a connection while a write to it
//! is blocked, so on one connection per client both sides can end up writing into full
//! buffers, each waiting for the other to read, until the write timeout drops the
//! connection.

use std::time::{Duration, Instant};

use fedpo_transport::{EmbeddedBroker, LinkEvent, LinkOptions, MqttLink};

const CHUNKS: usize = 48;

/// Publishes `CHUNKS` MiB to `topic`, then takes what arrived for this client: whether
/// every publish was acknowledged, the messages received and the connection drops seen.
fn stream(link: MqttLink, topic: &'static str) -> std::thread::JoinHandle<(bool, usize, usize)> {
    std::thread::spawn(move || {
        for i in 0..CHUNKS {
            link.publish(topic, vec![i as u8; 1 << 20]).unwrap();
        }
        let acked = link.flush(Duration::from_secs(60));
        let (mut got, mut drops) = (0, 0);
        let deadline = Instant::now() + Duration::from_secs(60);
        while got < CHUNKS && Instant::now() < deadline {
            match link.recv_timeout(Duration::from_millis(100)).unwrap() {
                Some(LinkEvent::Message(_)) => got += 1,
                Some(LinkEvent::Disconnected(_)) => drops += 1,
                _ => {}
            }
        }
        (acked, got, drops)
    })
}

#[test]
fn two_clients_streaming_to_each_other_at_once_neither_stall_nor_drop() {
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let link = |id: &str, topic: &str| {
        let mut opts = LinkOptions::new(id);
        // A stalled write shows as a dropped connection within the test's time.
        opts.connection_timeout = Duration::from_secs(10);
        let link = MqttLink::connect(&broker.url(), &opts).unwrap();
        link.subscribe(topic).unwrap();
        link
    };
    let (a, b) = (link("a", "t/to-a"), link("b", "t/to-b"));
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let (a, b) = (stream(a, "t/to-b"), stream(b, "t/to-a"));
    let (a, b) = (a.join().unwrap(), b.join().unwrap());
    assert_eq!((a.0, b.0), (true, true), "every publish acknowledged");
    assert_eq!((a.1, b.1), (CHUNKS, CHUNKS), "every chunk delivered");
    assert_eq!((a.2, b.2), (0, 0), "no connection dropped on a stalled write");
    assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
}
