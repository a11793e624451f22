//! One client connection of the embedded broker: the handshake, a reader that acts on
//! what the client sends, and a writer that drains the client's [`Queue`].
//!
//! The reader never buffers more than one packet: a publish is handed to every
//! subscriber's queue before the next packet is read, so a publisher is held while a
//! subscriber's queue is full, and a subscriber that makes no room for
//! [`BrokerLimits::stall`](super::BrokerLimits::stall) is disconnected rather than holding everyone.

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use rumqttc::mqttbytes::v4::{
    ConnAck, Connect, ConnectReturnCode, LastWill, Packet, PubAck, PubComp, PubRec, Publish, SubAck, Subscribe,
    SubscribeReasonCode, UnsubAck, Unsubscribe,
};
use rumqttc::mqttbytes::{valid_filter, valid_topic, Error as CodecError, Protocol, QoS};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::frames;
use super::queue::Queue;
use super::router::ConnId;
use super::Shared;

/// What other connections hold of this one: its queue, and the switch that ends it.
#[derive(Debug)]
pub(super) struct Client {
    pub(super) id: ConnId,
    pub(super) name: String,
    pub(super) queue: Queue,
    next_pkid: AtomicU16,
    end: watch::Sender<bool>,
}

impl Client {
    fn next_pkid(&self) -> u16 {
        loop {
            let id = self.next_pkid.fetch_add(1, Ordering::Relaxed);
            if id != 0 {
                return id;
            }
        }
    }

    /// Ends the connection: its reader and writer stop, its queue is freed.
    pub(super) fn end(&self) {
        self.end.send_replace(true);
        self.queue.close();
    }
}

/// Replies (acks, ping responses) a client may leave unread past its queue's limit
/// before it counts as not reading at all.
const REPLY_SLACK: usize = 64 << 10;

/// How a connection ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// The client sent DISCONNECT: no last will.
    Clean,
    /// Anything else: the will, if any, is published.
    Lost(String),
}

/// Reads one packet, with room for no more than `max` bytes of it.
async fn read_packet(reader: &mut (impl AsyncRead + Unpin), buf: &mut BytesMut, max: usize) -> Result<Packet, String> {
    loop {
        match Packet::read(buf, max) {
            Ok(packet) => {
                if buf.is_empty() && buf.capacity() > 64 << 10 {
                    *buf = BytesMut::with_capacity(4 << 10);
                }
                return Ok(packet);
            }
            Err(CodecError::InsufficientBytes(more)) => {
                buf.reserve(more);
                match reader.read_buf(buf).await {
                    Ok(0) => return Err("connection closed".into()),
                    Ok(_) => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
            Err(e) => return Err(format!("malformed packet: {e}")),
        }
    }
}

async fn write_now(stream: &mut TcpStream, packet: Packet) {
    let frame = frames::control(&packet);
    let _ = stream.write_all(&frame.head).await;
}

/// Serves one accepted connection to its end.
pub(super) async fn serve(shared: Arc<Shared>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let limits = shared.limits.clone();
    let mut buf = BytesMut::with_capacity(4 << 10);
    let first = read_packet(&mut stream, &mut buf, limits.max_packet_bytes);
    let connect = match tokio::time::timeout(limits.connect_timeout, first).await {
        Ok(Ok(Packet::Connect(c))) => c,
        _ => return,
    };
    let Some(session) = handshake(&shared, &mut stream, connect).await else { return };
    let (reader, writer) = stream.into_split();
    let client = session.client.clone();
    let writing = tokio::spawn(write_loop(client.clone(), writer));
    let end = read_loop(&shared, &session, reader, buf).await;
    shared.router().disconnect(client.id);
    client.end();
    let _ = writing.await;
    if let End::Lost(reason) = &end {
        tracing::debug!(client = %client.name, %reason, "broker connection lost");
        if let Some(will) = session.will {
            route(&shared, &will.topic, will.qos, Bytes::copy_from_slice(&will.message)).await;
        }
    }
}

/// A connection past its handshake.
struct Session {
    client: Arc<Client>,
    user: Option<String>,
    will: Option<LastWill>,
    keep_alive: Option<Duration>,
}

/// Checks a CONNECT and answers it; the session on success.
async fn handshake(shared: &Arc<Shared>, stream: &mut TcpStream, connect: Connect) -> Option<Session> {
    let refuse = |code| Packet::ConnAck(ConnAck::new(code, false));
    if connect.protocol != Protocol::V4 {
        write_now(stream, refuse(ConnectReturnCode::RefusedProtocolVersion)).await;
        return None;
    }
    let login = connect.login.as_ref().map(|l| (l.username.as_str(), l.password.as_str()));
    let user = match shared.access.login(login) {
        Ok(user) => user,
        Err(_) => {
            shared.warn(&connect.client_id, "refused login", "a client gave no listed login; refused");
            write_now(stream, refuse(ConnectReturnCode::BadUserNamePassword)).await;
            return None;
        }
    };
    if connect.client_id.is_empty() && !connect.clean_session {
        write_now(stream, refuse(ConnectReturnCode::BadClientId)).await;
        return None;
    }
    if let Some(will) = &connect.last_will {
        if !valid_topic(&will.topic) || !shared.access.may_publish(user.as_deref(), &will.topic) {
            shared.warn(&connect.client_id, "refused will", "a client's last will names a topic it may not publish to");
            write_now(stream, refuse(ConnectReturnCode::NotAuthorized)).await;
            return None;
        }
    }
    let name = if connect.client_id.is_empty() {
        format!("fedpo-broker-{:016x}", rand::random::<u64>())
    } else {
        connect.client_id.clone()
    };
    let (end, _) = watch::channel(false);
    let queue_limit = shared.queue_limit.clone();
    if shared.open.load(Ordering::Relaxed) > shared.limits.max_connections {
        shared.warn("broker", "connections", "the embedded broker is at its connection limit; refusing");
        write_now(stream, refuse(ConnectReturnCode::ServiceUnavailable)).await;
        return None;
    }
    let (client, replaced) = {
        let mut router = shared.router();
        let mut client = None;
        let (_, replaced) = router.connect((user.clone(), name.clone()), |id| {
            let c = Arc::new(Client {
                id,
                name: name.clone(),
                queue: Queue::new(queue_limit),
                next_pkid: AtomicU16::new(1),
                end,
            });
            client = Some(c.clone());
            c
        });
        (client?, replaced)
    };
    if let Some(old) = replaced {
        tracing::debug!(client = %name, "a new connection takes over the session");
        old.end();
    }
    write_now(stream, Packet::ConnAck(ConnAck::new(ConnectReturnCode::Success, false))).await;
    let keep_alive = (connect.keep_alive > 0).then(|| Duration::from_millis(u64::from(connect.keep_alive) * 1500));
    Some(Session { client, user, will: connect.last_will, keep_alive })
}

async fn ended(end: &mut watch::Receiver<bool>) {
    let _ = end.wait_for(|ended| *ended).await;
}

async fn read_loop(shared: &Arc<Shared>, session: &Session, mut reader: OwnedReadHalf, mut buf: BytesMut) -> End {
    let client = &session.client;
    let mut end = client.end.subscribe();
    let max = shared.limits.max_packet_bytes;
    loop {
        let next = async {
            match session.keep_alive {
                Some(wait) => tokio::time::timeout(wait, read_packet(&mut reader, &mut buf, max))
                    .await
                    .unwrap_or_else(|_| Err("no packet within 1.5 keep-alive intervals".into())),
                None => read_packet(&mut reader, &mut buf, max).await,
            }
        };
        let packet = tokio::select! {
            p = next => p,
            () = ended(&mut end) => return End::Lost("disconnected by the broker".into()),
        };
        let packet = match packet {
            Ok(p) => p,
            Err(reason) => return End::Lost(reason),
        };
        let reply = match packet {
            Packet::Publish(p) => {
                let Some(reply) = publish(shared, session, p).await else {
                    return End::Lost("a publish on an invalid topic".into());
                };
                reply
            }
            Packet::PubRel(rel) => Some(Packet::PubComp(PubComp::new(rel.pkid))),
            Packet::PubAck(_) | Packet::PubRec(_) | Packet::PubComp(_) => None,
            Packet::Subscribe(s) => Some(subscribe(shared, session, s)),
            Packet::Unsubscribe(Unsubscribe { pkid, topics }) => {
                let mut router = shared.router();
                for t in &topics {
                    router.unsubscribe(client.id, t);
                }
                Some(Packet::UnsubAck(UnsubAck::new(pkid)))
            }
            Packet::PingReq => Some(Packet::PingResp),
            Packet::Disconnect => return End::Clean,
            other => return End::Lost(format!("unexpected {:?} from a client", std::mem::discriminant(&other))),
        };
        if let Some(reply) = reply {
            match client.queue.push_reply(frames::control(&reply), REPLY_SLACK) {
                Ok(true) => {}
                Ok(false) => return End::Lost("the client sends but does not read".into()),
                Err(_) => return End::Lost("disconnected by the broker".into()),
            }
        }
    }
}

/// Routes a client's publish; the reply it is owed, `None` to drop the connection.
async fn publish(shared: &Arc<Shared>, session: &Session, p: Publish) -> Option<Option<Packet>> {
    if !valid_topic(&p.topic) || p.topic.is_empty() {
        return None;
    }
    let name = &session.client.name;
    if p.retain {
        shared.warn(name, "retained", "the embedded broker keeps no retained message; delivering it once");
    }
    if shared.access.may_publish(session.user.as_deref(), &p.topic) {
        // A copy of its own, so that the read buffer is not kept alive by queued frames.
        route(shared, &p.topic, p.qos, Bytes::copy_from_slice(&p.payload)).await;
    } else {
        shared.warn(name, "denied publish", "a client published on a topic it may not use; dropped");
    }
    Some(match p.qos {
        QoS::AtMostOnce => None,
        QoS::AtLeastOnce => Some(Packet::PubAck(PubAck::new(p.pkid))),
        QoS::ExactlyOnce => Some(Packet::PubRec(PubRec::new(p.pkid))),
    })
}

fn subscribe(shared: &Arc<Shared>, session: &Session, s: Subscribe) -> Packet {
    let mut router = shared.router();
    let codes = s
        .filters
        .iter()
        .map(|f| {
            let allowed = valid_filter(&f.path) && shared.access.may_subscribe(session.user.as_deref(), &f.path);
            match allowed.then(|| router.subscribe(session.client.id, &f.path, f.qos)).flatten() {
                Some(qos) => SubscribeReasonCode::Success(qos),
                None => {
                    shared.warn(&session.client.name, "denied subscribe", "a client's subscription was refused");
                    SubscribeReasonCode::Failure
                }
            }
        })
        .collect();
    Packet::SubAck(SubAck::new(s.pkid, codes))
}

/// Hands a publish to every subscriber's queue, waiting for room in each; a subscriber
/// that makes none within the stall limit is disconnected.
pub(super) async fn route(shared: &Arc<Shared>, topic: &str, qos: QoS, payload: Bytes) {
    let targets = shared.router().route(topic);
    for (client, granted) in targets {
        let qos = if granted < qos { granted } else { qos };
        let pkid = if qos == QoS::AtMostOnce { 0 } else { client.next_pkid() };
        let frame = frames::publish(topic, qos, pkid, payload.clone());
        if tokio::time::timeout(shared.limits.stall, client.queue.push(frame)).await.is_err() {
            shared.warn(&client.name, "stalled", "a client read nothing while its queue was full; disconnected");
            client.end();
        }
    }
}

/// Writes the client's queue to its socket until the connection ends.
async fn write_loop(client: Arc<Client>, writer: OwnedWriteHalf) {
    let mut end = client.end.subscribe();
    let mut out = BufWriter::with_capacity(64 << 10, writer);
    let written = async {
        while let Some(first) = client.queue.pop().await {
            let mut frame = Some(first);
            let mut bytes = 0;
            while let Some(f) = frame {
                out.write_all(&f.head).await?;
                out.write_all(&f.body).await?;
                bytes += f.len();
                frame = if bytes < (1 << 20) { client.queue.try_pop() } else { None };
            }
            out.flush().await?;
            client.queue.release(bytes);
        }
        Ok::<_, std::io::Error>(())
    };
    tokio::select! {
        r = written => if r.is_err() { client.end() },
        () = ended(&mut end) => {}
    }
    let _ = out.shutdown().await;
}
