//! Blocks from an HTTP(S) origin (decision 0062): a minimal HTTP/1.1 client for range requests,
//! and the workers the block fetcher (`crate::fetch_blocks`) hands block requests to.
//!
//! ```text
//! fetch_blocks ── (offset, length) ──> worker 1..N ── GET path, Range: bytes=a-b ──> origin
//!              <── OriginEvent ──────  (one keep-alive connection each)
//! ```
//!
//! - Only `http` and `https` are spoken ([`OriginUrl::parse`]); nothing else of the URL is
//!   trusted either: every block that comes back is checked against the signed block list by
//!   the worker that read it, on its own thread, before it is handed to the fetcher. A block
//!   that fails its hash is an [`OriginEvent::Failed`]; an [`OriginEvent::Block`] has matched.
//! - Blocks asked one after another are asked in one range request, a *run* of at most
//!   [`RUN_BYTES`] (a worker takes every request waiting in the queue that continues its run):
//!   one request per megabyte instead of one per block. The body is split into blocks as it
//!   arrives, each handed to the fetcher as soon as its last byte is read.
//! - `206 Partial Content` carries the run asked for: its `Content-Range` must start at the
//!   run's first byte and its length must be the run's. `200 OK` means the origin ignores `Range` (a plain
//!   static server such as Python's `http.server`): the first worker to see it streams the whole
//!   file once, handing every block to the fetcher as it passes, and every other worker drops
//!   its requests, since the stream will deliver them. Any other status (404, 5xx), a short
//!   body or a broken connection is an [`OriginEvent::Failed`] naming the block and the status;
//!   the fetcher then stops using the origin for the action.
//! - A redirect (301, 302, 303, 307, 308) is followed by the rules of [`crate::http_redirect`]
//!   (at most 3 hops, http or https only, never https to http, no loop); one it refuses is a
//!   failure of the block. Where a chain ends is remembered: the following requests for the
//!   artifact go there directly, until the fetcher is dropped (a restart starts again from the
//!   location the action names).
//! - HTTPS is checked against the system's roots and the device's `[origins] ca_file`
//!   ([`OriginTls`]).
//! - No timeouts here: the fetcher times every block it asked for, and aborts the workers (by
//!   dropping the [`OriginFetcher`]) when it stops using the origin.
//! - Bodies are read by `Content-Length`, `Transfer-Encoding: chunked`, or to the end of the
//!   connection; a response head over [`MAX_HEAD`] bytes is refused.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use flotilla_mqtt::https::OriginTls;
use flotilla_protocol::blocks::{block_range, BlockList};
use flotilla_protocol::origin::OriginUrl;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Mutex};
use tokio::task::JoinHandle;

use crate::http_redirect::{self, Redirects};

/// Most bytes a response head (status line and headers) may take.
pub const MAX_HEAD: usize = 16 * 1024;

/// Most connections to one origin at a time.
pub const MAX_CONNECTIONS: usize = 4;

/// Most bytes asked in one range request: a run of consecutive blocks.
pub const RUN_BYTES: u64 = 1024 * 1024;

/// What a worker tells the fetcher.
#[derive(Debug, PartialEq, Eq)]
pub enum OriginEvent {
    /// The block at `offset`, as the origin served it; it matched its signed hash.
    Block { offset: u64, data: Vec<u8> },
    /// The origin could not serve the block at `offset`, broke off its stream, or served bytes
    /// that fail the block's signed hash.
    Failed { offset: u64, reason: String },
}

/// The workers fetching blocks of one artifact from one origin. Dropping it stops them.
pub struct OriginFetcher {
    requests: mpsc::UnboundedSender<(u64, u32)>,
    events: mpsc::Receiver<OriginEvent>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for OriginFetcher {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// What the workers share.
struct Shared {
    /// Where requests go: the action's location, or where its redirects led.
    location: std::sync::Mutex<OriginUrl>,
    tls: OriginTls,
    /// The artifact's size (for a range-less stream) and its signed block list.
    size: u64,
    list: Arc<BlockList>,
    requests: Mutex<Requests>,
    events: mpsc::Sender<OriginEvent>,
    /// Set once the origin answered a range request with the whole file.
    streaming: AtomicBool,
}

impl OriginFetcher {
    /// Starts `connections` workers (at least one, at most [`MAX_CONNECTIONS`]) for the artifact
    /// of `size` bytes at `url`, whose blocks must match `list`; `tls` checks an HTTPS origin's
    /// certificate.
    pub fn start(
        url: OriginUrl,
        tls: OriginTls,
        size: u64,
        list: Arc<BlockList>,
        connections: usize,
    ) -> Self {
        let (requests, requests_rx) = mpsc::unbounded_channel();
        let connections = connections.clamp(1, MAX_CONNECTIONS);
        let (events_tx, events) = mpsc::channel(connections * 2);
        let shared = Arc::new(Shared {
            location: std::sync::Mutex::new(url),
            tls,
            size,
            list,
            requests: Mutex::new(Requests {
                queue: requests_rx,
                held: None,
            }),
            events: events_tx,
            streaming: AtomicBool::new(false),
        });
        let tasks = (0..connections)
            .map(|_| tokio::spawn(worker(shared.clone())))
            .collect();
        OriginFetcher {
            requests,
            events,
            tasks,
        }
    }

    /// Asks for `length` bytes at `offset`.
    pub fn ask(&self, offset: u64, length: u32) {
        let _ = self.requests.send((offset, length));
    }

    /// The next event; `None` once every worker has stopped.
    pub async fn next(&mut self) -> Option<OriginEvent> {
        self.events.recv().await
    }
}

trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

type Conn = BufReader<Box<dyn Stream>>;

/// A kept connection and the scheme, host and port it is open to.
type Kept = Option<((bool, String, u16), Conn)>;

impl Shared {
    fn location(&self) -> OriginUrl {
        self.location
            .lock()
            .map(|l| l.clone())
            .unwrap_or_else(|poisoned| poisoned.into_inner().clone())
    }

    /// The event for `data`, read for the block at `offset`: the block if it matches its
    /// signed hash, else a failure naming it.
    fn checked(&self, offset: u64, data: Vec<u8>) -> OriginEvent {
        let matches = self
            .list
            .index_at(offset)
            .is_some_and(|block| self.list.verify(block, &data));
        if matches {
            OriginEvent::Block { offset, data }
        } else {
            let reason = format!(
                "it served {} bytes that fail the block's signed hash",
                data.len()
            );
            OriginEvent::Failed { offset, reason }
        }
    }

    fn remember(&self, url: &OriginUrl) {
        if let Ok(mut location) = self.location.lock() {
            if *location != *url {
                tracing::info!(
                    to = %http_redirect::url_text(url),
                    "the HTTP origin redirects: asking there from now on"
                );
                *location = url.clone();
            }
        }
    }
}

/// The blocks asked of the origin, in the order asked.
struct Requests {
    queue: mpsc::UnboundedReceiver<(u64, u32)>,
    /// A request taken from the queue that did not continue the run being gathered.
    held: Option<(u64, u32)>,
}

impl Requests {
    /// The next request and every waiting one that continues it, up to [`RUN_BYTES`] in all:
    /// `(offset, length)` of each block, in order. `None` once the fetcher is gone.
    async fn next_run(&mut self) -> Option<Vec<(u64, u32)>> {
        let first = match self.held.take() {
            Some(request) => request,
            None => self.queue.recv().await?,
        };
        let mut run = vec![first];
        let mut end = first.0 + u64::from(first.1);
        let mut bytes = u64::from(first.1);
        while let Ok(next) = self.queue.try_recv() {
            if next.0 != end || bytes + u64::from(next.1) > RUN_BYTES {
                self.held = Some(next);
                break;
            }
            run.push(next);
            end += u64::from(next.1);
            bytes += u64::from(next.1);
        }
        Some(run)
    }
}

async fn worker(shared: Arc<Shared>) {
    let mut conn: Kept = None;
    loop {
        let Some(run) = shared.requests.lock().await.next_run().await else {
            return;
        };
        if shared.streaming.load(Ordering::Acquire) {
            continue; // the stream delivers it
        }
        let offset = run[0].0;
        let length: u64 = run.iter().map(|(_, n)| u64::from(*n)).sum();
        match range_get(&shared, &mut conn, offset, length).await {
            Ok(Reply::Range(c, framing, keep)) => match read_run(&shared, c, framing, &run).await {
                Ok(Some(c)) => conn = keep.map(|to| (to, c)),
                Ok(None) => conn = None,
                Err(Stop::Failed(event)) => {
                    conn = None;
                    if shared.events.send(event).await.is_err() {
                        return;
                    }
                }
                Err(Stop::Gone) => return,
            },
            Ok(Reply::Whole(mut whole, framing)) => {
                if shared.streaming.swap(true, Ordering::AcqRel) {
                    continue; // another worker streams the file
                }
                if let Err(event) = stream_whole(&shared, &mut whole, framing).await {
                    let _ = shared.events.send(event).await;
                }
                return;
            }
            Err(reason) => {
                conn = None;
                if shared
                    .events
                    .send(OriginEvent::Failed { offset, reason })
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
    }
}

/// Why a run's body stopped being read.
enum Stop {
    /// The origin broke off: the event names the block.
    Failed(OriginEvent),
    /// The fetcher is gone.
    Gone,
}

/// Reads a `206` body of the blocks of `run`, handing each to the fetcher as it completes; the
/// connection, if its body ended where the run does and it can be kept.
async fn read_run(
    shared: &Shared,
    mut c: Conn,
    mut framing: Framing,
    run: &[(u64, u32)],
) -> Result<Option<Conn>, Stop> {
    for &(offset, length) in run {
        let what = format!("bytes {offset}-{}", offset + u64::from(length).max(1) - 1);
        let failed = |reason: String| Stop::Failed(OriginEvent::Failed { offset, reason });
        let mut data = vec![0; length as usize];
        let got = fill(&mut c, &mut framing, &mut data)
            .await
            .map_err(|e| failed(format!("{what}: {e}")))?;
        if got < data.len() {
            return Err(failed(format!(
                "{what}: the origin's answer ended after {got} bytes of the block"
            )));
        }
        match shared.checked(offset, data) {
            event @ OriginEvent::Block { .. } => {
                if shared.events.send(event).await.is_err() {
                    return Err(Stop::Gone);
                }
            }
            failed => return Err(Stop::Failed(failed)),
        }
    }
    match framing {
        Framing::Length(0) => Ok(Some(c)),
        Framing::Chunked { .. } => {
            // Read the end of the chunked body so the connection can be kept.
            let mut rest = [0; 1];
            Ok(matches!(fill(&mut c, &mut framing, &mut rest).await, Ok(0)).then_some(c))
        }
        _ => Ok(None),
    }
}

/// How a response body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(u64),
    Chunked { left: u64, done: bool },
    Close,
}

enum Reply {
    /// A `206` for the range asked: its body follows on this connection, which is kept
    /// afterwards (open to this scheme, host and port) if the answer allows.
    Range(Conn, Framing, Option<(bool, String, u16)>),
    /// A `200 OK`: the whole file follows on this connection.
    Whole(Conn, Framing),
}

/// A response's status and the headers the client uses.
#[derive(Debug, Default)]
struct Head {
    status: u16,
    reason: String,
    length: Option<u64>,
    chunked: bool,
    /// The first byte of `Content-Range`.
    range_start: Option<u64>,
    /// `Location`, of a redirect.
    location: Option<String>,
    close: bool,
}

async fn connect(url: &OriginUrl, tls: &OriginTls) -> std::io::Result<Conn> {
    let tcp = TcpStream::connect((url.host.as_str(), url.port)).await?;
    tcp.set_nodelay(true)?;
    let stream: Box<dyn Stream> = if url.https {
        Box::new(tls.connect(&url.host, tcp).await?)
    } else {
        Box::new(tcp)
    };
    Ok(BufReader::with_capacity(64 * 1024, stream))
}

/// One range request for `length` bytes at `offset`, following redirects.
async fn range_get(
    shared: &Shared,
    conn: &mut Kept,
    offset: u64,
    length: u64,
) -> Result<Reply, String> {
    let last = offset + length.max(1) - 1;
    let what = format!("bytes {offset}-{last}");
    let mut hops = Redirects::new(shared.location());
    let (c, head) = loop {
        let (c, head) = send(shared, conn, hops.current(), offset, last)
            .await
            .map_err(|e| format!("{what}: {e}"))?;
        if !http_redirect::is_redirect(head.status) {
            break (c, head);
        }
        // The redirect's body is not read: its connection is dropped.
        hops.follow(head.status, head.location.as_deref())
            .map_err(|e| format!("{what}: {e}"))?;
    };
    if hops.followed() && matches!(head.status, 200 | 206) {
        shared.remember(hops.current());
    }
    let url = hops.current();
    let endpoint = (url.https, url.host.clone(), url.port);
    answer(shared, endpoint, c, head, offset, length)
}

/// Sends the range request to `url`, on the kept connection when it is open to the same place
/// (once more on a fresh one if a kept connection turns out closed); the connection and the
/// response head.
async fn send(
    shared: &Shared,
    conn: &mut Kept,
    url: &OriginUrl,
    offset: u64,
    last: u64,
) -> Result<(Conn, Head), String> {
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nRange: bytes={offset}-{last}\r\n\
         Accept-Encoding: identity\r\nUser-Agent: flotilla-agent\r\n\r\n",
        url.path,
        url.host_header()
    );
    let endpoint = (url.https, url.host.clone(), url.port);
    if conn.as_ref().is_some_and(|(to, _)| *to != endpoint) {
        *conn = None;
    }
    let mut attempt = 0;
    loop {
        attempt += 1;
        let reused = conn.is_some();
        let mut c = match conn.take() {
            Some((_, c)) => c,
            None => connect(url, &shared.tls)
                .await
                .map_err(|e| format!("cannot connect to {}:{}: {e}", url.host, url.port))?,
        };
        let sent = c.get_mut().write_all(request.as_bytes()).await;
        let head = match sent {
            Ok(()) => read_head(&mut c).await,
            Err(e) => Err(e.to_string()),
        };
        match head {
            Ok(head) => return Ok((c, head)),
            Err(_) if reused && attempt == 1 => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Checks the head of the answer to a range request that was not a redirect; `c` is open to
/// `endpoint`, and may be kept there once the body is read.
fn answer(
    shared: &Shared,
    endpoint: (bool, String, u16),
    c: Conn,
    head: Head,
    offset: u64,
    length: u64,
) -> Result<Reply, String> {
    let what = format!("bytes {offset}-{}", offset + length.max(1) - 1);
    let framing = framing(&head);
    match head.status {
        206 => {
            if head.range_start.is_some_and(|s| s != offset) {
                return Err(format!(
                    "{what}: the origin answered with bytes from {}",
                    head.range_start.unwrap_or_default()
                ));
            }
            if head.length.is_some_and(|n| n != length) {
                return Err(format!(
                    "{what}: the origin answered with {} bytes",
                    head.length.unwrap_or_default()
                ));
            }
            Ok(Reply::Range(c, framing, (!head.close).then_some(endpoint)))
        }
        200 => {
            if head.length.is_some_and(|n| n != shared.size) {
                return Err(format!(
                    "{what}: the origin ignores ranges and its file is {} bytes, not the \
                     artifact's {}",
                    head.length.unwrap_or_default(),
                    shared.size
                ));
            }
            Ok(Reply::Whole(c, framing))
        }
        status => Err(format!(
            "{what}: the origin answered HTTP {status} {}",
            head.reason
        )),
    }
}

/// Hands every block of a `200 OK` body to the fetcher, in order.
async fn stream_whole(
    shared: &Shared,
    c: &mut Conn,
    mut framing: Framing,
) -> Result<(), OriginEvent> {
    let url = shared.location();
    tracing::info!(
        origin = %format!("{}:{}{}", url.host, url.port, url.path),
        "the origin ignores range requests: streaming the whole file once"
    );
    let block_size = shared.list.block_size();
    let blocks = shared.size.div_ceil(u64::from(block_size.max(1)));
    for block in 0..blocks {
        let (offset, length) = block_range(block, shared.size, block_size);
        let mut data = vec![0; length as usize];
        let failed = |reason: String| OriginEvent::Failed { offset, reason };
        let got = fill(c, &mut framing, &mut data)
            .await
            .map_err(|e| failed(format!("whole-file stream at byte {offset}: {e}")))?;
        if got < data.len() {
            return Err(failed(format!(
                "whole-file stream ended at byte {}",
                offset + got as u64
            )));
        }
        match shared.checked(offset, data) {
            event @ OriginEvent::Block { .. } => {
                if shared.events.send(event).await.is_err() {
                    return Ok(());
                }
            }
            failed => return Err(failed),
        }
    }
    Ok(())
}

fn framing(head: &Head) -> Framing {
    if head.chunked {
        Framing::Chunked {
            left: 0,
            done: false,
        }
    } else if let Some(n) = head.length {
        Framing::Length(n)
    } else {
        Framing::Close
    }
}

/// Reads one line (without its CRLF) of at most `limit` bytes.
async fn read_line(c: &mut Conn, limit: usize) -> Result<String, String> {
    let mut line = Vec::new();
    let n = (&mut *c)
        .take(limit as u64 + 1)
        .read_until(b'\n', &mut line)
        .await
        .map_err(|e| e.to_string())?;
    if n == 0 {
        return Err("the origin closed the connection".to_owned());
    }
    if !line.ends_with(b"\n") {
        return Err(format!("a line of the response is over {limit} bytes"));
    }
    while matches!(line.last(), Some(b'\n' | b'\r')) {
        line.pop();
    }
    String::from_utf8(line).map_err(|_| "the response head is not text".to_owned())
}

async fn read_head(c: &mut Conn) -> Result<Head, String> {
    let mut budget = MAX_HEAD;
    let status_line = read_line(c, budget).await?;
    budget = budget.saturating_sub(status_line.len() + 2);
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(format!("not an HTTP/1 response: {:.80}", status_line));
    }
    let mut head = Head {
        status: parts
            .next()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("no status in {:.80}", status_line))?,
        reason: parts.next().unwrap_or_default().to_owned(),
        // HTTP/1.0 closes unless asked to keep the connection.
        close: version == "HTTP/1.0",
        ..Head::default()
    };
    loop {
        if budget == 0 {
            return Err(format!("the response head is over {MAX_HEAD} bytes"));
        }
        let line = read_line(c, budget).await?;
        budget = budget.saturating_sub(line.len() + 2);
        if line.is_empty() {
            break;
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err(format!("a malformed header: {:.80}", line));
        };
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => {
                head.length = Some(
                    value
                        .parse()
                        .map_err(|_| format!("Content-Length {value:.40} is not a number"))?,
                )
            }
            "transfer-encoding" => head.chunked = value.to_ascii_lowercase().contains("chunked"),
            "connection" => match value.to_ascii_lowercase().as_str() {
                "close" => head.close = true,
                "keep-alive" => head.close = false,
                _ => {}
            },
            "location" => head.location = Some(value.to_owned()),
            "content-range" => {
                head.range_start = value
                    .strip_prefix("bytes ")
                    .and_then(|r| r.split('-').next())
                    .and_then(|s| s.trim().parse().ok())
            }
            _ => {}
        }
    }
    Ok(head)
}

/// Reads body bytes into `buf` until it is full or the body ends; returns how many.
async fn fill(c: &mut Conn, framing: &mut Framing, buf: &mut [u8]) -> Result<usize, String> {
    let mut got = 0;
    while got < buf.len() {
        let n = body_read(c, framing, &mut buf[got..]).await?;
        if n == 0 {
            break;
        }
        got += n;
    }
    Ok(got)
}

async fn body_read(c: &mut Conn, framing: &mut Framing, buf: &mut [u8]) -> Result<usize, String> {
    let eof = || "the origin closed the connection in the middle of the body".to_owned();
    match framing {
        Framing::Length(0) | Framing::Chunked { done: true, .. } => Ok(0),
        Framing::Length(left) => {
            let want = (*left).min(buf.len() as u64) as usize;
            let n = c.read(&mut buf[..want]).await.map_err(|e| e.to_string())?;
            if n == 0 {
                return Err(eof());
            }
            *left -= n as u64;
            Ok(n)
        }
        Framing::Close => c.read(buf).await.map_err(|e| e.to_string()),
        Framing::Chunked { left, done } => {
            if *left == 0 {
                let line = read_line(c, 1024).await?;
                let size = line.split(';').next().unwrap_or_default().trim();
                *left = u64::from_str_radix(size, 16)
                    .map_err(|_| format!("a malformed chunk size {size:.20}"))?;
                if *left == 0 {
                    // Trailers, up to the empty line.
                    while !read_line(c, 1024).await?.is_empty() {}
                    *done = true;
                    return Ok(0);
                }
            }
            let want = (*left).min(buf.len() as u64) as usize;
            let n = c.read(&mut buf[..want]).await.map_err(|e| e.to_string())?;
            if n == 0 {
                return Err(eof());
            }
            *left -= n as u64;
            if *left == 0 && !read_line(c, 2).await?.is_empty() {
                return Err("a chunk is longer than its size".to_owned());
            }
            Ok(n)
        }
    }
}

#[cfg(test)]
#[path = "http_origin_tests.rs"]
pub(crate) mod tests;
