//! The link against the embedded broker: large chunks, QoS 1 delivery, last will.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use fedpo_transport::{EmbeddedBroker, LinkEvent, LinkOptions, MqttLink};

fn next_message(link: &MqttLink, within: Duration) -> Option<(String, Vec<u8>)> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(LinkEvent::Message(d)) = link.recv_timeout(Duration::from_millis(100)).unwrap() {
            return Some((d.topic, d.payload.to_vec()));
        }
    }
    None
}

/// A scripted broker on a free loopback port: it accepts one client, reads its CONNECT,
/// then hands the socket to `after_connect`, whose result the join handle returns.
fn one_client_broker<T: Send + 'static>(
    after_connect: impl FnOnce(std::net::TcpStream) -> T + Send + 'static,
) -> (u16, std::thread::JoinHandle<T>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let broker = std::thread::spawn(move || {
        let (mut sock, _) = listener.accept().unwrap();
        let mut connect = [0u8; 256];
        let _ = sock.read(&mut connect).unwrap();
        after_connect(sock)
    });
    (port, broker)
}

#[test]
fn one_mib_chunks_arrive_whole_and_in_order_through_the_embedded_broker() {
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let rx = MqttLink::connect(&broker.url(), &LinkOptions::new("rx")).unwrap();
    rx.subscribe("fedpo/t/down").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let tx = MqttLink::connect(&broker.url(), &LinkOptions::new("tx")).unwrap();
    let chunks: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i; (1 << 20) + 100]).collect();
    for c in &chunks {
        tx.publish("fedpo/t/down", c.clone()).unwrap();
    }
    assert!(tx.flush(Duration::from_secs(20)), "the broker acknowledged every publish");
    assert_eq!(tx.unacked(), 0);
    for expected in &chunks {
        let (topic, payload) = next_message(&rx, Duration::from_secs(20)).expect("chunk delivered");
        assert_eq!(topic, "fedpo/t/down");
        assert_eq!(&payload, expected);
    }
}

#[test]
fn last_will_is_published_when_a_client_vanishes_but_not_on_a_clean_close() {
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let watcher = MqttLink::connect(&broker.url(), &LinkOptions::new("watcher")).unwrap();
    watcher.subscribe("fedpo/t/up/+").unwrap();
    std::thread::sleep(Duration::from_millis(200));

    let mut polite = LinkOptions::new("polite");
    polite.last_will = Some(("fedpo/t/up/polite".into(), b"gone".to_vec()));
    MqttLink::connect(&broker.url(), &polite).unwrap().close(Duration::from_secs(1));
    assert_eq!(next_message(&watcher, Duration::from_secs(2)), None, "a clean close sends no will");

    // A client that vanishes (a killed process) gets its will published. Speak raw MQTT
    // so the socket can be dropped without a DISCONNECT.
    let mut sock = std::net::TcpStream::connect(broker.addr()).unwrap();
    sock.write_all(&connect_packet_with_will("rude", "fedpo/t/up/rude", b"offline")).unwrap();
    let mut connack = [0u8; 4];
    sock.read_exact(&mut connack).unwrap();
    assert_eq!(connack, [0x20, 2, 0, 0], "connection accepted");
    drop(sock);
    let (topic, payload) = next_message(&watcher, Duration::from_secs(5)).expect("will published");
    assert_eq!((topic.as_str(), payload.as_slice()), ("fedpo/t/up/rude", b"offline".as_slice()));
}

#[test]
fn connecting_to_a_closed_port_fails_in_time_naming_the_broker() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = fedpo_transport::BrokerUrl::parse(&format!("mqtt://127.0.0.1:{port}")).unwrap();
    let mut opts = LinkOptions::new("nobody");
    opts.connect_wait = Duration::from_secs(1);
    let err = MqttLink::connect(&url, &opts).err().expect("nothing listens there").to_string();
    assert!(err.contains(&format!("127.0.0.1:{port}")) && err.contains("1 s"), "{err}");
}

#[test]
fn a_broker_that_accepts_tcp_but_never_answers_fails_after_connect_wait_not_the_write_timeout() {
    // The kernel completes the TCP handshake into the listener's backlog; nothing ever
    // reads the CONNECT, so rumqttc's connect attempt runs until `connection_timeout`.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let url = fedpo_transport::BrokerUrl::parse(&format!("mqtt://127.0.0.1:{port}")).unwrap();
    let mut opts = LinkOptions::new("patient");
    opts.connect_wait = Duration::from_secs(1);
    opts.connection_timeout = Duration::from_secs(40);
    let started = Instant::now();
    let err = MqttLink::connect(&url, &opts).err().expect("the broker never sends a ConnAck").to_string();
    let waited = started.elapsed();
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
    assert!(waited < Duration::from_secs(10), "connect returned after {waited:?}, not about connect_wait (1 s)");
}

#[test]
fn a_session_that_comes_up_after_the_link_gave_up_is_ended_with_a_disconnect_not_the_will() {
    // A broker that answers the CONNECT only after the link has given up and stopped
    // waiting for its thread (connect_wait 1 s, then the 2 s shutdown grace).
    let (port, slow) = one_client_broker(|mut sock| {
        std::thread::sleep(Duration::from_millis(4500));
        sock.write_all(&[0x20, 2, 0, 0]).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut next = [0u8; 2];
        sock.read_exact(&mut next).map(|()| next)
    });
    let url = fedpo_transport::BrokerUrl::parse(&format!("mqtt://127.0.0.1:{port}")).unwrap();
    let mut opts = LinkOptions::new("late");
    opts.connect_wait = Duration::from_secs(1);
    opts.last_will = Some(("fedpo/t/up/late".into(), b"offline".to_vec()));
    assert!(MqttLink::connect(&url, &opts).is_err(), "no ConnAck within connect_wait");
    let after_connack = slow.join().unwrap().expect("a packet after the ConnAck, not a dropped socket");
    assert_eq!(after_connack, [0xE0, 0x00], "a DISCONNECT, so the broker drops the will");
}

#[test]
fn closing_a_link_whose_broker_went_away_returns_without_waiting_out_the_backoff() {
    // A one-shot broker: accepts the link's two CONNECTs, answers them, then closes the
    // sockets and the port, so every reconnect is refused and the backoff doubles.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let one_shot = std::thread::spawn(move || {
        let sockets: Vec<_> = (0..2)
            .map(|_| {
                let (mut sock, _) = listener.accept().unwrap();
                let _ = sock.read(&mut [0u8; 256]).unwrap();
                sock.write_all(&[0x20, 2, 0, 0]).unwrap();
                sock
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        drop(sockets);
    });
    let url = fedpo_transport::BrokerUrl::parse(&format!("mqtt://127.0.0.1:{port}")).unwrap();
    let mut opts = LinkOptions::new("left-behind");
    opts.max_backoff = Duration::from_secs(30);
    let link = MqttLink::connect(&url, &opts).unwrap();
    one_shot.join().unwrap();
    // Reconnects fail at once; after 4 s the loop sleeps between attempts for over 3 s.
    std::thread::sleep(Duration::from_secs(4));
    let started = Instant::now();
    link.close(Duration::ZERO);
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(1), "close took {waited:?}, waiting out the reconnect backoff");
}

/// An MQTT 3.1.1 CONNECT with a QoS 1 will and a clean session.
fn connect_packet_with_will(client: &str, will_topic: &str, will: &[u8]) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, s: &[u8]) {
        out.extend_from_slice(&(s.len() as u16).to_be_bytes());
        out.extend_from_slice(s);
    }
    let mut body = Vec::new();
    string(&mut body, b"MQTT");
    body.push(4); // protocol level 3.1.1
    body.push(0b0000_1110); // will QoS 1, will flag, clean session
    body.extend_from_slice(&30u16.to_be_bytes());
    string(&mut body, client.as_bytes());
    string(&mut body, will_topic.as_bytes());
    string(&mut body, will);
    assert!(body.len() < 128);
    let mut packet = vec![0x10, body.len() as u8];
    packet.extend(body);
    packet
}

/// A TCP relay in front of the broker whose connections can be cut, as a flaky network
/// or a restarting broker would.
struct CuttableRelay {
    addr: std::net::SocketAddr,
    live: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl CuttableRelay {
    fn start(upstream: std::net::SocketAddr) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let live = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let conns = live.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = std::net::TcpStream::connect(upstream) else { continue };
                conns.lock().unwrap().extend([client.try_clone().unwrap(), server.try_clone().unwrap()]);
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server.try_clone().unwrap(), client.try_clone().unwrap()),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Self { addr, live }
    }

    fn cut(&self) {
        for s in self.live.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

#[test]
fn publishes_cut_off_by_a_dropped_connection_are_resent_after_reconnecting() {
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let rx = MqttLink::connect(&broker.url(), &LinkOptions::new("rx")).unwrap();
    rx.subscribe("fedpo/t/up/tx").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let relay = CuttableRelay::start(broker.addr());
    let url = fedpo_transport::BrokerUrl::parse(&format!("mqtt://{}", relay.addr)).unwrap();
    let mut opts = LinkOptions::new("tx");
    opts.max_backoff = Duration::from_millis(200);
    let tx = MqttLink::connect(&url, &opts).unwrap();
    // The subscription is live once a probe gets through (a fixed sleep is not enough on
    // a loaded machine: publishes before the broker's SubAck are not delivered).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        tx.publish("fedpo/t/up/tx", b"probe".to_vec()).unwrap();
        if next_message(&rx, Duration::from_millis(500)).is_some_and(|(_, p)| p == b"probe") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the subscription never became live");
    }
    while next_message(&rx, Duration::from_millis(200)).is_some() {} // late probes
    let payloads: Vec<Vec<u8>> = (0..24u8).map(|i| vec![i; 256 << 10]).collect();
    for (i, p) in payloads.iter().enumerate() {
        tx.publish("fedpo/t/up/tx", p.clone()).unwrap();
        // Cuts land mid-stream, so some publishes are written and unacknowledged, some
        // still queued in the client, and some made while it reconnects.
        if i % 4 == 3 {
            relay.cut();
        }
    }
    assert!(tx.flush(Duration::from_secs(30)), "every publish acknowledged after reconnecting");
    let mut events = Vec::new();
    while let Ok(Some(e)) = tx.recv_timeout(Duration::from_millis(10)) {
        events.push(e);
    }
    assert!(events.iter().any(|e| matches!(e, LinkEvent::Disconnected(_))), "the cut was noticed");
    assert!(events.iter().filter(|e| matches!(e, LinkEvent::Connected)).count() >= 2, "and it reconnected");
    let mut seen = std::collections::BTreeSet::new();
    while let Some((_, p)) = next_message(&rx, Duration::from_secs(3)) {
        if p.len() == 256 << 10 {
            seen.insert(p[0]);
        }
    }
    assert_eq!(seen.len(), payloads.len(), "every payload arrived at least once: {seen:?}");
}
