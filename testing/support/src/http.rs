//! A small blocking HTTP/1.1 client over `std::net::TcpStream` for the multi-process tests:
//! one request per connection (`Connection: close`), `Content-Length` and chunked bodies,
//! and Server-Sent Events read incrementally with a read timeout, so that a stream that
//! stops making progress fails the test instead of hanging it.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// How long a read of a stream may block before the stream counts as hung.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a whole (not streamed) response may take to start: its first byte comes only
/// once the request is done, and a 3,000-token prompt on the real model takes 15 s on an
/// idle 2-core machine and over 30 s on a loaded one (a fresh-clone CI beside the suite).
pub const WHOLE_RESPONSE_TIMEOUT: Duration = Duration::from_secs(180);

/// A whole response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    /// Header names lowercased, in arrival order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON of type `T`; panics with the body when it does not parse.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> T {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {}: body does not parse as {}: {e}\n{}",
                self.status,
                std::any::type_name::<T>(),
                self.text()
            )
        })
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == &name.to_ascii_lowercase())
        .map(|(_, v)| v.as_str())
}

/// `GET path`.
pub fn get(addr: SocketAddr, path: &str) -> io::Result<Response> {
    request(addr, "GET", path, None, &[])
}

/// `POST path` with a JSON body.
pub fn post_json(addr: SocketAddr, path: &str, body: &str) -> io::Result<Response> {
    request(addr, "POST", path, Some(body.as_bytes()), &[])
}

/// Sends one request and reads the whole response.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    extra_headers: &[(&str, &str)],
) -> io::Result<Response> {
    let (status, headers, mut reader) = send(
        addr,
        method,
        path,
        body,
        extra_headers,
        WHOLE_RESPONSE_TIMEOUT,
    )?;
    let mut body = Vec::new();
    reader.read_to_end(&mut body)?;
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// Sends only a request head that declares `content_length` bytes of body, and reads the
/// answer: for checking that an oversized body is refused from its declared length.
pub fn post_declaring_length(
    addr: SocketAddr,
    path: &str,
    content_length: usize,
) -> io::Result<Response> {
    let stream = connect(addr, READ_TIMEOUT)?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n"
    );
    (&stream).write_all(head.as_bytes())?;
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader)?;
    let mut body = Vec::new();
    // The server may close as soon as it has answered; what arrived is enough.
    let _ = body_reader(reader, &headers).read_to_end(&mut body);
    Ok(Response {
        status,
        headers,
        body,
    })
}

fn connect(addr: SocketAddr, read_timeout: Duration) -> io::Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(read_timeout))?;
    stream.set_write_timeout(Some(READ_TIMEOUT))?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

type Head = (u16, Vec<(String, String)>, Box<dyn Read + Send>);

fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    extra_headers: &[(&str, &str)],
    read_timeout: Duration,
) -> io::Result<Head> {
    let stream = connect(addr, read_timeout)?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in extra_headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    let mut w = &stream;
    w.write_all(head.as_bytes())?;
    if let Some(b) = body {
        w.write_all(b)?;
    }
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader)?;
    let body = body_reader(reader, &headers);
    Ok((status, headers, body))
}

fn read_head(reader: &mut BufReader<TcpStream>) -> io::Result<(u16, Vec<(String, String)>)> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed before a response",
        ));
    }
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("bad status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l
            .split_once(':')
            .ok_or_else(|| bad(format!("bad header {l:?}")))?;
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    Ok((status, headers))
}

fn body_reader(reader: BufReader<TcpStream>, headers: &[(String, String)]) -> Box<dyn Read + Send> {
    let chunked = header(headers, "transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    if chunked {
        return Box::new(Chunked {
            inner: reader,
            left: 0,
            done: false,
        });
    }
    match header(headers, "content-length").and_then(|v| v.parse::<u64>().ok()) {
        Some(n) => Box::new(reader.take(n)),
        None => Box::new(reader),
    }
}

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// A chunked transfer-encoded body, decoded as it arrives.
struct Chunked {
    inner: BufReader<TcpStream>,
    /// Bytes left in the current chunk.
    left: usize,
    done: bool,
}

impl Read for Chunked {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            if self.inner.read_line(&mut line)? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a chunked body",
                ));
            }
            let size = line.trim().split(';').next().unwrap_or("");
            let size = usize::from_str_radix(size, 16)
                .map_err(|_| bad(format!("bad chunk size {line:?}")))?;
            if size == 0 {
                // Trailers (none expected) up to the empty line.
                loop {
                    line.clear();
                    if self.inner.read_line(&mut line)? == 0 || line.trim().is_empty() {
                        break;
                    }
                }
                self.done = true;
                return Ok(0);
            }
            self.left = size;
        }
        let n = buf.len().min(self.left);
        let n = self.inner.read(&mut buf[..n])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed inside a chunk",
            ));
        }
        self.left -= n;
        if self.left == 0 {
            let mut crlf = [0u8; 2];
            self.inner.read_exact(&mut crlf)?;
        }
        Ok(n)
    }
}

/// An SSE response read event by event.
pub struct EventStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    lines: BufReader<Box<dyn Read + Send>>,
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

/// How an event stream ended.
#[derive(Debug)]
pub enum StreamEnd {
    /// `data: [DONE]` arrived.
    Done,
    /// The connection closed (cleanly or not) without `[DONE]`.
    Closed(String),
}

/// `POST path` with a JSON body, for a streaming (SSE) answer.
pub fn post_stream(addr: SocketAddr, path: &str, body: &str) -> io::Result<EventStream> {
    post_stream_with(addr, path, body, &[])
}

/// [`post_stream`] with more request headers (an API key).
pub fn post_stream_with(
    addr: SocketAddr,
    path: &str,
    body: &str,
    extra_headers: &[(&str, &str)],
) -> io::Result<EventStream> {
    let (status, headers, reader) = send(
        addr,
        "POST",
        path,
        Some(body.as_bytes()),
        extra_headers,
        READ_TIMEOUT,
    )?;
    Ok(EventStream {
        status,
        headers,
        lines: BufReader::new(reader),
    })
}

impl EventStream {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// Reads every remaining event: the payloads, and how the stream ended.
    pub fn collect(&mut self) -> (Vec<String>, StreamEnd) {
        let mut events = Vec::new();
        loop {
            match self.next_event() {
                Ok(Event::Data(d)) => events.push(d),
                Ok(Event::Done) => return (events, StreamEnd::Done),
                Ok(Event::Eof) => return (events, StreamEnd::Closed("end of body".into())),
                Err(e) => return (events, StreamEnd::Closed(e.to_string())),
            }
        }
    }

    /// [`collect`](Self::collect), with when each event arrived.
    pub fn collect_timed(&mut self) -> (Vec<(std::time::Instant, String)>, StreamEnd) {
        let mut events = Vec::new();
        loop {
            match self.next_event() {
                Ok(Event::Data(d)) => events.push((std::time::Instant::now(), d)),
                Ok(Event::Done) => return (events, StreamEnd::Done),
                Ok(Event::Eof) => return (events, StreamEnd::Closed("end of body".into())),
                Err(e) => return (events, StreamEnd::Closed(e.to_string())),
            }
        }
    }

    /// The next event. A read that blocks longer than [`READ_TIMEOUT`] is an error.
    pub fn next_event(&mut self) -> io::Result<Event> {
        let mut data: Option<String> = None;
        loop {
            let mut line = String::new();
            if self.lines.read_line(&mut line)? == 0 {
                return Ok(match data {
                    Some(d) if d == "[DONE]" => Event::Done,
                    Some(d) => Event::Data(d),
                    None => Event::Eof,
                });
            }
            let l = line.trim_end_matches(['\r', '\n']);
            if l.is_empty() {
                match data.take() {
                    Some(d) if d == "[DONE]" => return Ok(Event::Done),
                    Some(d) => return Ok(Event::Data(d)),
                    None => continue,
                }
            }
            if let Some(v) = l.strip_prefix("data:") {
                let v = v.strip_prefix(' ').unwrap_or(v);
                match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(v);
                    }
                    None => data = Some(v.to_string()),
                }
            }
            // Comments (`:`) and other fields are not used by the frontend: skipped.
        }
    }
}

/// One server-sent event.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// A `data:` payload other than `[DONE]`.
    Data(String),
    /// `data: [DONE]`.
    Done,
    /// The body ended without `[DONE]`.
    Eof,
}
