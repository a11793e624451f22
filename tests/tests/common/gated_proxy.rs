//! A loopback TCP forwarder with a gate, placed between a fleet and its broker.
//!
//! A scenario that restarts the broker needs its wiretap subscribed again before any
//! device reconnects and resends; otherwise what the tap missed cannot be checked. The
//! fleet connects through this proxy and the tap connects to the broker directly: with
//! the gate closed every connection attempt is dropped at once (clients back off and
//! retry), and opening it lets them through to the broker as it is then.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub struct GatedProxy {
    port: u16,
    open: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl GatedProxy {
    /// Listens on a free loopback port and forwards to `upstream` on loopback; open.
    pub fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy binds");
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = Arc::new(AtomicBool::new(true));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (open, stop) = (open.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    match listener.accept() {
                        Ok((client, _)) if open.load(Ordering::SeqCst) => forward(client, upstream),
                        Ok((client, _)) => drop(client),
                        Err(_) => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            })
        };
        Self { port, open, stop, thread: Some(thread) }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Drops every new connection until [`GatedProxy::open`]; established ones carry on
    /// until either side closes.
    pub fn close(&self) {
        self.open.store(false, Ordering::SeqCst);
    }

    pub fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

impl Drop for GatedProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Connects to the upstream and pumps both directions on their own threads; when either
/// direction ends, both sockets are shut down so the client sees the broker go.
fn forward(client: TcpStream, upstream: u16) {
    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else { return };
    client.set_nonblocking(false).unwrap();
    let pump = |mut from: TcpStream, mut to: TcpStream| {
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            while let Ok(n @ 1..) = from.read(&mut buf) {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = from.shutdown(Shutdown::Both);
            let _ = to.shutdown(Shutdown::Both);
        });
    };
    pump(client.try_clone().unwrap(), server.try_clone().unwrap());
    pump(server, client);
}
