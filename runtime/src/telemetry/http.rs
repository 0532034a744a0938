//! An HTTP endpoint for Prometheus to scrape: `GET /metrics`. Off unless
//! [`Telemetry::serve_metrics`](crate::Telemetry::serve_metrics) starts it; plain `std::net`, one
//! thread, one request per connection. Part of the `prometheus` feature.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use super::Metrics;
use super::prometheus::CONTENT_TYPE;
use crate::error::Result;

/// Reads the metrics to serve; `None` once the runtime is gone.
pub(crate) type ReadMetrics = Box<dyn Fn() -> Option<Result<Metrics>> + Send>;

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
    pub(crate) fn start(read: ReadMetrics, addr: impl ToSocketAddrs) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new().name("steppool-metrics".into()).spawn(move || {
            for connection in listener.incoming() {
                if flag.load(Ordering::Acquire) {
                    break;
                }
                if let Ok(stream) = connection {
                    // A client that misbehaves loses its own request, nothing else.
                    let _ = answer(stream, &read);
                }
            }
        })?;
        Ok(Self { addr, stop, thread: Some(thread) })
    }
}

fn answer(mut stream: TcpStream, read: &ReadMetrics) -> io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut reader = BufReader::new(Read::take(stream.try_clone()?, 16 * 1024));
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // Drain the headers, up to the blank line.
    let mut line = String::new();
    while reader.read_line(&mut line)? > 2 {
        line.clear();
    }
    let mut parts = request_line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, content_type, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => match read() {
            Some(Ok(metrics)) => ("200 OK", CONTENT_TYPE, metrics.to_prometheus()),
            Some(Err(error)) => ("500 Internal Server Error", "text/plain", format!("{error}\n")),
            None => ("503 Service Unavailable", "text/plain", "the runtime is gone\n".to_owned()),
        },
        ("GET", _) => ("404 Not Found", "text/plain", "steppool serves /metrics\n".to_owned()),
        _ => ("405 Method Not Allowed", "text/plain", "GET only\n".to_owned()),
    };
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
        // fails the thread is already gone.
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
