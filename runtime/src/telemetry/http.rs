//! An HTTP endpoint for Prometheus to scrape: `GET /metrics`. Off unless
//! [`Telemetry::serve_metrics`](crate::Telemetry::serve_metrics) starts it. Part of the
//! `prometheus` feature.
//!
//! Plain `std::net`: one thread accepts, and each connection is answered on a short-lived thread
//! of its own, so a client that sends slowly, or not at all, holds only its own thread. Two
//! bounds keep hostile local clients from costing more than that:
//! - at most [`ServeOptions::max_connections`] connections are handled at once (from accept
//!   until the answer is written: the place is given back before the client sees the answer
//!   end, so a client that asks again at once finds it free); one more is answered `503` at once
//!   and closed;
//! - a request has [`ServeOptions::request_deadline`] in all, from its acceptance to the end of
//!   its answer, whatever pace the client keeps (a read or write timeout alone would let a
//!   client that trickles one byte at a time hold its thread for ever); past it the client gets
//!   `408` and the connection is closed.
//!
//! The request line and headers may take [`MAX_REQUEST_BYTES`]; a longer head gets `431`,
//! anything but an HTTP/1.x request line `400`. A connection turned away is answered without its
//! request being read. A crate (tiny_http, hyper) would bring a server
//! and its dependencies into every build that scrapes; the endpoint needs one route, one method
//! and these two bounds, which fit in this file.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Metrics;
use super::prometheus::CONTENT_TYPE;
use crate::error::Result;

/// Reads the metrics to serve; `None` once the runtime is gone.
pub(crate) type ReadMetrics = Arc<dyn Fn() -> Option<Result<Metrics>> + Send + Sync>;

/// The most bytes a request's line and headers may take.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;

/// How a metrics endpoint treats its clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServeOptions {
    /// Connections handled at once; one more is answered `503` and closed. Default 64.
    pub max_connections: usize,
    /// The time a request has in all, from its acceptance to the end of its answer. Default 5 s.
    pub request_deadline: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self { max_connections: 64, request_deadline: Duration::from_secs(5) }
    }
}

/// A running metrics endpoint; stops when dropped.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// The address it listens on (useful after binding port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves what `read` returns at `addr`, from a thread of its own.
    pub(crate) fn start(read: ReadMetrics, addr: impl ToSocketAddrs, options: ServeOptions) -> io::Result<Self> {
        if options.max_connections == 0 || options.request_deadline.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a metrics endpoint needs at least one connection and a non-zero deadline \
                     (max_connections {}, request_deadline {:?})",
                    options.max_connections, options.request_deadline
                ),
            ));
        }
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("steppool-metrics".into())
            .spawn(move || accept_loop(&listener, &flag, &read, options))?;
        Ok(Self { addr, stop, thread: Some(thread) })
    }
}

/// Accepts until `stop`, handing each connection to a thread of its own while fewer than
/// `max_connections` are being handled.
fn accept_loop(listener: &TcpListener, stop: &AtomicBool, read: &ReadMetrics, options: ServeOptions) {
    let active = Arc::new(AtomicUsize::new(0));
    for connection in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let Ok(stream) = connection else { continue };
        let accepted = Instant::now();
        if active.fetch_add(1, Ordering::AcqRel) >= options.max_connections {
            active.fetch_sub(1, Ordering::AcqRel);
            // Refused without reading: a short write timeout, so a client that does not read
            // cannot hold the accept loop either.
            let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = respond(&stream, "503 Service Unavailable", "text/plain", "too many connections\n");
            let _ = stream.shutdown(Shutdown::Write);
            continue;
        }
        let guard = Active(active.clone());
        let read = read.clone();
        let deadline = accepted + options.request_deadline;
        let spawned = std::thread::Builder::new()
            .name("steppool-metrics-conn".into())
            // Reading a request and formatting the metrics need little stack.
            .stack_size(256 * 1024)
            .spawn(move || {
                let mut stream = stream;
                // A client that misbehaves loses its own request, nothing else.
                let _ = answer(&mut stream, &read, deadline);
                // The place is given back before the client can see the answer end: a client
                // that has read it and asks again finds it free, whether or not it has closed
                // this connection, and however long the drain below waits for it to.
                drop(guard);
                let _ = stream.shutdown(Shutdown::Write);
                linger(&mut stream);
            });
        // Without a thread the connection is dropped (closed), and its guard with the closure.
        drop(spawned);
    }
}

/// Counts a connection being handled until dropped.
struct Active(Arc<AtomicUsize>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why a request was not read.
enum Refusal {
    /// The deadline passed first.
    Late,
    /// The head is longer than [`MAX_REQUEST_BYTES`].
    TooLarge,
    /// The connection failed or closed early.
    Io,
}

/// Reads the request's line and headers, up to the blank line, within the deadline.
fn read_head(stream: &mut TcpStream, deadline: Instant) -> std::result::Result<Vec<u8>, Refusal> {
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Refusal::Late);
        }
        stream.set_read_timeout(Some(left)).map_err(|_| Refusal::Io)?;
        let n = match stream.read(&mut chunk) {
            Ok(0) => return Err(Refusal::Io),
            Ok(n) => n,
            Err(error) if matches!(error.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(Refusal::Late);
            }
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Err(Refusal::Io),
        };
        // Only the new bytes and the three before them can complete the blank line.
        let from = head.len().saturating_sub(3);
        head.extend_from_slice(&chunk[..n]);
        if let Some(end) = head[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            head.truncate(from + end);
            return if head.len() > MAX_REQUEST_BYTES { Err(Refusal::TooLarge) } else { Ok(head) };
        }
        if head.len() > MAX_REQUEST_BYTES {
            return Err(Refusal::TooLarge);
        }
    }
}

fn answer(stream: &mut TcpStream, read: &ReadMetrics, deadline: Instant) -> io::Result<()> {
    let head = match read_head(stream, deadline) {
        Ok(head) => head,
        Err(refusal) => {
            // A short grace for the refusal itself, then the connection closes.
            stream.set_write_timeout(Some(Duration::from_millis(200)))?;
            return match refusal {
                Refusal::Late => respond(stream, "408 Request Timeout", "text/plain", "request too slow\n"),
                Refusal::TooLarge => respond(
                    stream,
                    "431 Request Header Fields Too Large",
                    "text/plain",
                    &format!("request head over {MAX_REQUEST_BYTES} bytes\n"),
                ),
                Refusal::Io => Ok(()),
            };
        }
    };
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split(' ');
    let (method, target, version) = (parts.next(), parts.next(), parts.next());
    let (status, content_type, body) = match (method, target, version) {
        (Some(method), Some(target), Some(version)) if version.starts_with("HTTP/1.") && parts.next().is_none() => {
            match (method, target.split('?').next().unwrap_or_default()) {
                ("GET", "/metrics") => match read() {
                    Some(Ok(metrics)) => ("200 OK", CONTENT_TYPE, metrics.to_prometheus()),
                    Some(Err(error)) => ("500 Internal Server Error", "text/plain", format!("{error}\n")),
                    None => ("503 Service Unavailable", "text/plain", "the runtime is gone\n".to_owned()),
                },
                ("GET", _) => ("404 Not Found", "text/plain", "steppool serves /metrics\n".to_owned()),
                _ => ("405 Method Not Allowed", "text/plain", "GET only\n".to_owned()),
            }
        }
        _ => ("400 Bad Request", "text/plain", "not an HTTP/1.x request line\n".to_owned()),
    };
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_write_timeout(Some(left))?;
    respond(stream, status, content_type, &body)
}

/// After the answer (whose end the client has seen), reads and drops what the client still
/// sends, for a moment and a few KiB at most, until it closes: closing a socket with unread
/// bytes resets the connection, and a reset can discard the answer before the client reads it.
fn linger(stream: &mut TcpStream) {
    if stream.set_read_timeout(Some(Duration::from_millis(200))).is_err() {
        return;
    }
    let mut sink = [0u8; 1024];
    for _ in 0..64 {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Writes a whole response; the caller then ends the connection's sending side, which is when
/// the client sees the answer end.
fn respond(mut stream: &TcpStream, status: &str, content_type: &str, body: &str) -> io::Result<()> {
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop (at loopback when bound to every address); if the connection
        // fails the thread is already gone. Connection threads finish by their deadline.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(if wake.is_ipv4() { Ipv4Addr::LOCALHOST.into() } else { Ipv6Addr::LOCALHOST.into() });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
