use super::*;
use std::net::SocketAddr;
use tokio::net::TcpListener;

/// How the test origin answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Serves {
    /// `206` with the range asked for, on a kept connection.
    Ranges,
    /// `206` with the range, in chunked encoding.
    Chunked,
    /// `200` with the whole file, ignoring `Range`, then closes (as Python's `http.server`).
    Whole,
    /// Ranges with one byte flipped in each.
    Corrupt,
    /// As `Whole`, with the first byte flipped.
    WholeCorrupt,
    /// Serves this many ranges, then `404 Not Found`.
    NotFoundAfter(usize),
    /// Accepts connections and never answers.
    Silent,
    /// `302 Found` to `http://127.0.0.1:{port}/artifact.bin`.
    RedirectTo(u16),
    /// Ranges whose body breaks off (the connection closed) after this many bytes.
    CutAfter(usize),
}

/// Starts an origin serving `data` on a free loopback port; returns its URL.
pub(crate) async fn serve(data: Vec<u8>, serves: Serves) -> OriginUrl {
    serve_with(data, serves, None).await.0
}

/// As [`serve`], over TLS when `tls` is given; also how many requests it answered.
async fn serve_with(
    data: Vec<u8>,
    serves: Serves,
    tls: Option<rumqttc::tokio_rustls::TlsAcceptor>,
) -> (OriginUrl, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr: SocketAddr = listener.local_addr().expect("addr");
    let data = Arc::new(data);
    let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let scheme = if tls.is_some() { "https" } else { "http" };
    let counted = served.clone();
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                return;
            };
            let data = data.clone();
            let served = served.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let _ = match tls {
                    None => connection(sock, &data, serves, &served).await,
                    Some(tls) => match tls.accept(sock).await {
                        Ok(sock) => connection(sock, &data, serves, &served).await,
                        Err(e) => Err(e),
                    },
                };
            });
        }
    });
    let url = OriginUrl::parse(&format!("{scheme}://{addr}/artifact.bin")).expect("url");
    (url, counted)
}

async fn connection(
    sock: impl AsyncRead + AsyncWrite + Unpin,
    data: &[u8],
    serves: Serves,
    served: &std::sync::atomic::AtomicUsize,
) -> std::io::Result<()> {
    let mut c = BufReader::new(sock);
    loop {
        let mut range = None;
        loop {
            let mut line = String::new();
            if c.read_line(&mut line).await? == 0 {
                return Ok(());
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some(r) = line.strip_prefix("Range: bytes=") {
                let (a, b) = r.split_once('-').expect("a-b");
                range = Some((
                    a.parse::<usize>().expect("a"),
                    b.parse::<usize>().expect("b"),
                ));
            }
        }
        if serves == Serves::Silent {
            std::future::pending::<()>().await;
        }
        let n = served.fetch_add(1, Ordering::SeqCst);
        let (a, b) = range.expect("a Range header");
        let out = c.get_mut();
        match serves {
            Serves::RedirectTo(port) => {
                let head = format!(
                    "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:{port}/artifact.bin\r\n\
                     Content-Length: 0\r\n\r\n"
                );
                out.write_all(head.as_bytes()).await?;
            }
            Serves::NotFoundAfter(k) if n >= k => {
                out.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    .await?;
            }
            Serves::Whole | Serves::WholeCorrupt => {
                let head = format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n", data.len());
                out.write_all(head.as_bytes()).await?;
                let mut body = data.to_vec();
                if serves == Serves::WholeCorrupt {
                    body[0] ^= 1;
                }
                out.write_all(&body).await?;
                return Ok(());
            }
            Serves::Chunked => {
                let body = &data[a..=b];
                let (x, y) = body.split_at(body.len() / 2);
                let head = format!(
                    "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{}\r\n\
                     Transfer-Encoding: chunked\r\n\r\n{:x}\r\n",
                    data.len(),
                    x.len()
                );
                out.write_all(head.as_bytes()).await?;
                out.write_all(x).await?;
                out.write_all(format!("\r\n{:x}\r\n", y.len()).as_bytes())
                    .await?;
                out.write_all(y).await?;
                out.write_all(b"\r\n0\r\n\r\n").await?;
            }
            Serves::CutAfter(n) => {
                let head = format!(
                    "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{}\r\n\
                     Content-Length: {}\r\n\r\n",
                    data.len(),
                    b + 1 - a
                );
                out.write_all(head.as_bytes()).await?;
                out.write_all(&data[a..=b.min(a + n - 1)]).await?;
                return Ok(());
            }
            _ => {
                let mut body = data[a..=b].to_vec();
                if serves == Serves::Corrupt {
                    body[0] ^= 1;
                }
                let head = format!(
                    "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{}\r\n\
                     Content-Length: {}\r\n\r\n",
                    data.len(),
                    body.len()
                );
                out.write_all(head.as_bytes()).await?;
                out.write_all(&body).await?;
            }
        }
    }
}

fn data(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 % 251) as u8).collect()
}

/// The block list of `data` in blocks of `bs`, as a release signs it.
fn list_of(data: &[u8], bs: u32) -> Arc<BlockList> {
    Arc::new(BlockList::compute(data, bs).expect("a block list"))
}

/// Asks for every block of `data` and collects what comes back, by offset.
async fn fetch_all(url: OriginUrl, data: &[u8], bs: u32) -> Vec<OriginEvent> {
    fetch_all_with(url, OriginTls::default(), data, bs).await
}

/// As [`fetch_all`], checking an HTTPS origin's certificate with `tls`.
async fn fetch_all_with(url: OriginUrl, tls: OriginTls, data: &[u8], bs: u32) -> Vec<OriginEvent> {
    let mut f = OriginFetcher::start(url, tls, data.len() as u64, list_of(data, bs), 3);
    let blocks = (data.len() as u64).div_ceil(u64::from(bs));
    for b in 0..blocks {
        let (offset, length) = block_range(b, data.len() as u64, bs);
        f.ask(offset, length);
    }
    let mut events = Vec::new();
    let mut got = 0;
    while got < blocks {
        let e = f.next().await.expect("an event");
        got += 1;
        let failed = matches!(e, OriginEvent::Failed { .. });
        events.push(e);
        if failed {
            break;
        }
    }
    events.sort_by_key(|e| match e {
        OriginEvent::Block { offset, .. } | OriginEvent::Failed { offset, .. } => *offset,
    });
    events
}

fn blocks_of(data: &[u8], bs: u32) -> Vec<OriginEvent> {
    data.chunks(bs as usize)
        .enumerate()
        .map(|(i, c)| OriginEvent::Block {
            offset: (i * bs as usize) as u64,
            data: c.to_vec(),
        })
        .collect()
}

#[tokio::test]
async fn range_requests_return_each_block_on_kept_connections() {
    let d = data(10_000);
    for serves in [Serves::Ranges, Serves::Chunked] {
        let url = serve(d.clone(), serves).await;
        assert_eq!(
            fetch_all(url, &d, 1024).await,
            blocks_of(&d, 1024),
            "{serves:?}"
        );
    }
}

#[tokio::test]
async fn blocks_asked_in_a_row_are_asked_in_runs_of_a_megabyte() {
    const BS: u32 = 64 * 1024;
    // 49 blocks, the last one short.
    let d = data(3 * RUN_BYTES as usize + 100);
    let (url, served) = serve_with(d.clone(), Serves::Ranges, None).await;
    assert_eq!(fetch_all(url, &d, BS).await, blocks_of(&d, BS));
    // 16 blocks a request: 16 + 16 + 16 + 1.
    assert_eq!(served.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn a_run_broken_off_delivers_its_whole_blocks_and_names_the_broken_one() {
    let d = data(10 * 1024);
    let url = serve(d.clone(), Serves::CutAfter(2500)).await;
    let list = list_of(&d, 1024);
    let mut f = OriginFetcher::start(url, OriginTls::default(), d.len() as u64, list, 1);
    for b in 0..10 {
        f.ask(b * 1024, 1024);
    }
    let mut events = Vec::new();
    while let Some(e) = f.next().await {
        let failed = matches!(e, OriginEvent::Failed { .. });
        events.push(e);
        if failed {
            break;
        }
    }
    assert_eq!(events[..2], blocks_of(&d[..2048], 1024)[..]);
    match &events[2] {
        OriginEvent::Failed { offset, reason } => {
            assert_eq!(*offset, 2048);
            assert!(reason.contains("bytes 2048-3071"), "{reason}");
            assert!(reason.contains("closed the connection"), "{reason}");
        }
        other => panic!("not a failure: {other:?}"),
    }
}

#[tokio::test]
async fn a_block_failing_its_signed_hash_is_a_failure_naming_it_not_a_block() {
    let d = data(4096);
    for serves in [Serves::Corrupt, Serves::WholeCorrupt] {
        let url = serve(d.clone(), serves).await;
        let events = fetch_all(url, &d, 1024).await;
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, OriginEvent::Block { offset: 0, .. })),
            "{serves:?}: a corrupt block was handed over"
        );
        let reason = failure(&events);
        assert!(
            reason.contains("fail the block's signed hash"),
            "{serves:?}: {reason}"
        );
    }
}

#[tokio::test]
async fn an_origin_that_ignores_ranges_is_streamed_once_whole() {
    let d = data(10_000);
    let url = serve(d.clone(), Serves::Whole).await;
    assert_eq!(fetch_all(url, &d, 1024).await, blocks_of(&d, 1024));
}

#[tokio::test]
async fn a_404_is_a_failure_naming_the_range_and_the_status() {
    let d = data(4096);
    let url = serve(d.clone(), Serves::NotFoundAfter(0)).await;
    let events = fetch_all(url, &d, 1024).await;
    let reason = events
        .iter()
        .find_map(|e| match e {
            OriginEvent::Failed { reason, .. } => Some(reason.clone()),
            _ => None,
        })
        .expect("a failure");
    assert!(reason.contains("HTTP 404 Not Found"), "{reason}");
    assert!(reason.contains("bytes "), "{reason}");
}

#[tokio::test]
async fn a_hostile_head_is_refused_not_read_forever() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.expect("accept");
        let mut buf = [0; 1024];
        let _ = sock.read(&mut buf).await;
        let _ = sock.write_all(b"HTTP/1.1 206 OK\r\nX: ").await;
        let _ = sock.write_all(&vec![b'a'; MAX_HEAD * 2]).await;
    });
    let url = OriginUrl::parse(&format!("http://{addr}/x")).expect("url");
    let list = list_of(&[0; 1024], 1024);
    let mut f = OriginFetcher::start(url, OriginTls::default(), 1024, list, 1);
    f.ask(0, 1024);
    match f.next().await.expect("an event") {
        OriginEvent::Failed { reason, .. } => assert!(reason.contains("over"), "{reason}"),
        other => panic!("not refused: {other:?}"),
    }
}

/// Starts a server answering every request with `status` and a `Location` made by `location`
/// from its own address; returns its URL and how many requests it answered.
async fn redirector(
    status: u16,
    location: impl Fn(SocketAddr) -> String + Send + Sync + 'static,
) -> (OriginUrl, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (location, counter) = (Arc::new(location(addr)), answered.clone());
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let (location, counter) = (location.clone(), counter.clone());
            tokio::spawn(async move {
                let mut c = BufReader::new(sock);
                loop {
                    let mut line = String::new();
                    match c.read_line(&mut line).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) if line.trim_end().is_empty() => {
                            counter.fetch_add(1, Ordering::SeqCst);
                            let head = format!(
                                "HTTP/1.1 {status} Moved\r\nLocation: {location}\r\n\
                                 Content-Length: 5\r\n\r\nmoved"
                            );
                            if c.get_mut().write_all(head.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                        Ok(_) => {}
                    }
                }
            });
        }
    });
    let url = OriginUrl::parse(&format!("http://{addr}/artifact.bin")).expect("url");
    (url, answered)
}

fn failure(events: &[OriginEvent]) -> String {
    events
        .iter()
        .find_map(|e| match e {
            OriginEvent::Failed { reason, .. } => Some(reason.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no failure in {events:?}"))
}

#[tokio::test]
async fn a_redirect_is_followed_and_its_end_asked_directly_from_then_on() {
    let d = data(20_000);
    let target = serve(d.clone(), Serves::Ranges).await;
    for status in [301, 302, 303, 307, 308] {
        let to = format!("http://{}:{}/artifact.bin", target.host, target.port);
        let (url, answered) = redirector(status, move |_| to.clone()).await;
        assert_eq!(
            fetch_all(url, &d, 1024).await,
            blocks_of(&d, 1024),
            "{status}"
        );
        // 20 blocks on 3 connections: each worker is redirected once at most, then asks where
        // the redirect led.
        let redirected = answered.load(Ordering::SeqCst);
        assert!(
            (1..=3).contains(&redirected),
            "{status}: {redirected} redirects"
        );
    }
}

#[tokio::test]
async fn a_redirect_loop_or_too_many_hops_fails_the_block_naming_why() {
    let d = data(4096);
    // A URL that redirects to itself.
    let (url, _) = redirector(302, |addr| format!("http://{addr}/artifact.bin")).await;
    let reason = failure(&fetch_all(url, &d, 1024).await);
    assert!(reason.contains("a redirect loop"), "{reason}");
    assert!(reason.contains("bytes "), "the block is named: {reason}");

    // Four servers in a row, each redirecting to the next: the fourth redirect is refused.
    let last = serve(d.clone(), Serves::Ranges).await;
    let mut next = format!("http://{}:{}/artifact.bin", last.host, last.port);
    for _ in 0..4 {
        let to = next.clone();
        let (url, _) = redirector(307, move |_| to.clone()).await;
        next = format!("http://{}:{}/artifact.bin", url.host, url.port);
    }
    let url = OriginUrl::parse(&next).expect("url");
    let reason = failure(&fetch_all(url, &d, 1024).await);
    assert!(reason.contains("more than 3 redirects"), "{reason}");
}

#[tokio::test]
async fn a_redirect_to_another_scheme_fails_the_block_naming_it() {
    let d = data(4096);
    let (url, _) = redirector(301, |_| "file:///etc/passwd".to_owned()).await;
    let reason = failure(&fetch_all(url, &d, 1024).await);
    assert!(
        reason.contains("file:///etc/passwd") && reason.contains("only http:// and https://"),
        "{reason}"
    );
}

/// A private CA (`ca.crt`) and a certificate it signed for 127.0.0.1, made in `dir` by the
/// shipped `make-certs.sh` (openssl must be installed), and a TLS acceptor serving with it.
fn private_ca(dir: &std::path::Path) -> rumqttc::tokio_rustls::TlsAcceptor {
    use rumqttc::tokio_rustls::rustls;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/mosquitto/make-certs.sh");
    for args in [&["ca"][..], &["server", "origin", "IP:127.0.0.1"]] {
        let out = std::process::Command::new("sh")
            .arg(&script)
            .arg(dir)
            .args(args)
            .output()
            .expect("run make-certs.sh");
        assert!(out.status.success(), "make-certs.sh {args:?}: {out:?}");
    }
    let certs = CertificateDer::pem_file_iter(dir.join("origin.crt"))
        .and_then(|c| c.collect::<Result<Vec<_>, _>>())
        .expect("certificate");
    let key = PrivateKeyDer::from_pem_file(dir.join("origin.key")).expect("key");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("server config");
    rumqttc::tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

#[tokio::test]
async fn an_https_origin_is_trusted_with_its_private_ca_and_refused_without() {
    let dir = tempfile::tempdir().expect("tempdir");
    let acceptor = private_ca(dir.path());
    let with_ca = OriginTls::with_ca_file(&dir.path().join("ca.crt")).expect("the CA");
    let d = data(10_000);
    let url = serve_with(d.clone(), Serves::Ranges, Some(acceptor))
        .await
        .0;
    assert!(url.https);
    assert_eq!(
        fetch_all_with(url.clone(), with_ca, &d, 1024).await,
        blocks_of(&d, 1024)
    );
    let reason = failure(&fetch_all(url, &d, 1024).await);
    assert!(
        reason.contains("invalid peer certificate") && reason.contains("UnknownIssuer"),
        "{reason}"
    );
}

#[tokio::test]
async fn a_redirect_from_https_to_plain_http_is_refused_as_a_downgrade() {
    let dir = tempfile::tempdir().expect("tempdir");
    let acceptor = private_ca(dir.path());
    let with_ca = OriginTls::with_ca_file(&dir.path().join("ca.crt")).expect("the CA");
    let d = data(4096);
    let plain = serve(d.clone(), Serves::Ranges).await;
    let url = serve_with(d.clone(), Serves::RedirectTo(plain.port), Some(acceptor))
        .await
        .0;
    let reason = failure(&fetch_all_with(url, with_ca, &d, 1024).await);
    assert!(
        reason.contains("downgrade from https to plain http")
            && reason.contains(&format!("http://127.0.0.1:{}/artifact.bin", plain.port)),
        "{reason}"
    );
}
