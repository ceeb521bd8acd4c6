//! SWUpdate's IPC messages, as SWUpdate 2022.12 (Debian 12) lays them out: encoding and decoding
//! only, no sockets, so the byte layout is tested on its own.
//!
//! Two C structs cross the sockets, written and read whole in the machine's own byte order and
//! alignment (`include/network_ipc.h`, `include/progress_ipc.h`):
//!
//! - `ipc_message` on the install socket (`sockinstctrl`): `magic`, `type`, then a union whose
//!   largest member is the install request (`struct swupdate_request` + a length + a 2 KiB
//!   buffer). `swupdate_request.len` is a `size_t`, so the union's size and every offset after
//!   that field differ between 64-bit targets (x86-64, aarch64: 3,120 bytes) and 32-bit ARM
//!   (armhf: 3,104 bytes). The daemon reads exactly `sizeof(ipc_message)` and refuses anything
//!   shorter, so the size must be right, not just the fields we use.
//! - `progress_msg` on the progress socket (`swupdateprog`): 2,416 bytes on all three, because
//!   its one 64-bit field is 8-aligned on armhf's EABI too.
//!
//! Every target flotilla ships for is little-endian; the offsets below are the C compiler's for
//! those ABIs, pinned by the tests at the end of this file (checked against gcc for x86-64,
//! aarch64 and armhf with the 2022.12 headers). A newer SWUpdate whose `swupdate_request` grew
//! would refuse these messages by their size; decision record 0052 says why only 2022.12's
//! layout is spoken.

/// `IPC_MAGIC`: the first field of every `ipc_message`.
pub(crate) const IPC_MAGIC: u32 = 0x1405_2001;
/// `SWUPDATE_API_VERSION`, which the daemon checks in an install request.
const API_VERSION: u32 = 1;
/// `SOURCE_LOCAL` of `sourcetype`: the install comes from a local client.
const SOURCE_LOCAL: u32 = 4;

/// `sizeof(size_t)`: 8 on 64-bit targets, 4 on 32-bit ARM.
#[cfg(target_pointer_width = "64")]
const SIZE_T: usize = 8;
#[cfg(target_pointer_width = "32")]
const SIZE_T: usize = 4;

const fn align(offset: usize, to: usize) -> usize {
    offset.div_ceil(to) * to
}

/// Offsets inside `struct swupdate_request`.
mod req {
    use super::{align, SIZE_T};
    pub const APIVERSION: usize = 0;
    pub const SOURCE: usize = 4;
    pub const DRY_RUN: usize = 8;
    /// `size_t len`, aligned to its own size.
    pub const LEN: usize = align(12, SIZE_T);
    pub const INFO: usize = LEN + SIZE_T;
    pub const SOFTWARE_SET: usize = INFO + 512;
    pub const RUNNING_MODE: usize = SOFTWARE_SET + 256;
    pub const DISABLE_STORE_SWU: usize = RUNNING_MODE + 256;
    /// The struct is padded to the alignment of `size_t`.
    pub const SIZE: usize = align(DISABLE_STORE_SWU + 1, SIZE_T);
}

/// Offsets inside `ipc_message` (from its start).
mod msg {
    use super::{align, req, SIZE_T};
    pub const MAGIC: usize = 0;
    pub const TYPE: usize = 4;
    /// The union `msgdata`, aligned like its most aligned member (the `size_t` in the request).
    pub const DATA: usize = align(8, SIZE_T);
    /// `data.instmsg.req`.
    pub const REQ: usize = DATA;
    /// `data.status.current`, `last_result`, `error`, `desc[2048]`.
    pub const STATUS_CURRENT: usize = DATA;
    pub const STATUS_LAST_RESULT: usize = DATA + 4;
    pub const STATUS_ERROR: usize = DATA + 8;
    pub const STATUS_DESC: usize = DATA + 12;
    pub const DESC_LEN: usize = 2048;
    /// `data.msg[128]`: the text of a NACK ("Installation in progress").
    pub const TEXT_LEN: usize = 128;
    /// `data.instmsg`: the request, `unsigned int len`, `char buf[2048]`, padded; the union's
    /// largest member.
    pub const INSTMSG_SIZE: usize = align(req::SIZE + 4 + 2048, SIZE_T);
    pub const SIZE: usize = DATA + INSTMSG_SIZE;
}

/// `sizeof(ipc_message)`: what every read and write on the install socket moves.
pub(crate) const MSG_SIZE: usize = msg::SIZE;

/// Offsets inside `struct progress_msg`.
mod prog {
    pub const STATUS: usize = 4;
    pub const NSTEPS: usize = 24;
    pub const CUR_STEP: usize = 28;
    pub const CUR_PERCENT: usize = 32;
    pub const CUR_IMAGE: usize = 36;
    pub const HND_NAME: usize = 292;
    pub const SIZE: usize = 2416;
}

/// `sizeof(struct progress_msg)`.
pub(crate) const PROGRESS_SIZE: usize = prog::SIZE;

/// The `msgtype` values flotilla sends or reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MsgType {
    ReqInstall,
    Ack,
    Nack,
    GetStatus,
    /// Any other value (a notification, a reply to a request flotilla does not make).
    Other(u32),
}

impl MsgType {
    fn code(self) -> u32 {
        match self {
            MsgType::ReqInstall => 0,
            MsgType::Ack => 1,
            MsgType::Nack => 2,
            MsgType::GetStatus => 3,
            MsgType::Other(code) => code,
        }
    }

    fn from_code(code: u32) -> Self {
        match code {
            0 => MsgType::ReqInstall,
            1 => MsgType::Ack,
            2 => MsgType::Nack,
            3 => MsgType::GetStatus,
            other => MsgType::Other(other),
        }
    }
}

/// `RECOVERY_STATUS`, the daemon's state and the result of the last install.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recovery {
    Idle,
    Start,
    Run,
    Success,
    Failure,
    Download,
    Done,
    Subprocess,
    Progress,
    Other(u32),
}

impl Recovery {
    fn from_code(code: u32) -> Self {
        match code {
            0 => Recovery::Idle,
            1 => Recovery::Start,
            2 => Recovery::Run,
            3 => Recovery::Success,
            4 => Recovery::Failure,
            5 => Recovery::Download,
            6 => Recovery::Done,
            7 => Recovery::Subprocess,
            8 => Recovery::Progress,
            other => Recovery::Other(other),
        }
    }
}

fn put_u32(buf: &mut [u8], at: usize, value: u32) {
    buf[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

fn get_u32(buf: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&buf[at..at + 4]);
    u32::from_le_bytes(b)
}

/// A NUL-terminated C string in `buf[at..at + len]`, lossily as UTF-8.
fn get_cstr(buf: &[u8], at: usize, len: usize) -> String {
    let field = &buf[at..at + len];
    let end = field.iter().position(|&b| b == 0).unwrap_or(len);
    String::from_utf8_lossy(&field[..end]).into_owned()
}

fn header(kind: MsgType) -> Vec<u8> {
    let mut buf = vec![0u8; MSG_SIZE];
    put_u32(&mut buf, msg::MAGIC, IPC_MAGIC);
    put_u32(&mut buf, msg::TYPE, kind.code());
    buf
}

/// `REQ_INSTALL` for an image of `image_len` bytes, as `swupdate_prepare_req` fills it: API
/// version 1, source local, the daemon's own dry-run setting, no software set (the daemon's `-e`
/// decides), the image kept from being stored twice only if the daemon was told (`-o`).
pub(crate) fn install_request(image_len: u64) -> Vec<u8> {
    let mut buf = header(MsgType::ReqInstall);
    let r = msg::REQ;
    put_u32(&mut buf, r + req::APIVERSION, API_VERSION);
    put_u32(&mut buf, r + req::SOURCE, SOURCE_LOCAL);
    put_u32(&mut buf, r + req::DRY_RUN, 0); // RUN_DEFAULT
    let len = &mut buf[r + req::LEN..r + req::LEN + SIZE_T];
    #[cfg(target_pointer_width = "64")]
    len.copy_from_slice(&image_len.to_le_bytes());
    #[cfg(target_pointer_width = "32")]
    len.copy_from_slice(&u32::try_from(image_len).unwrap_or(u32::MAX).to_le_bytes());
    buf[r + req::DISABLE_STORE_SWU] = 0;
    buf
}

/// `GET_STATUS`: the daemon's state and its next queued message.
pub(crate) fn status_request() -> Vec<u8> {
    header(MsgType::GetStatus)
}

/// A decoded reply on the install socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub kind: MsgType,
    /// `data.msg` read as text: why a request was refused ("Installation in progress").
    pub text: String,
    /// `data.status`, meaningful in the answer to `GET_STATUS`.
    pub status: Status,
}

/// `data.status` of an answer to `GET_STATUS`: with a queued message, `current` is that
/// message's status (`Failure` for SWUpdate's `ERROR` lines) and `desc` its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Status {
    pub current: Recovery,
    pub last_result: Recovery,
    pub error: u32,
    pub desc: String,
}

/// Decodes one `ipc_message` the daemon sent.
pub(crate) fn parse_reply(buf: &[u8]) -> Result<Reply, String> {
    if buf.len() != MSG_SIZE {
        return Err(format!(
            "a reply of {} bytes, expected {MSG_SIZE}",
            buf.len()
        ));
    }
    let magic = get_u32(buf, msg::MAGIC);
    if magic != IPC_MAGIC {
        return Err(format!(
            "a reply with magic {magic:#010x}, expected {IPC_MAGIC:#010x}"
        ));
    }
    Ok(Reply {
        kind: MsgType::from_code(get_u32(buf, msg::TYPE)),
        text: get_cstr(buf, msg::DATA, msg::TEXT_LEN),
        status: Status {
            current: Recovery::from_code(get_u32(buf, msg::STATUS_CURRENT)),
            last_result: Recovery::from_code(get_u32(buf, msg::STATUS_LAST_RESULT)),
            error: get_u32(buf, msg::STATUS_ERROR),
            desc: get_cstr(buf, msg::STATUS_DESC, msg::DESC_LEN),
        },
    })
}

/// The fields of a `progress_msg` the agent logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Progress {
    pub status: Recovery,
    pub nsteps: u32,
    pub cur_step: u32,
    pub cur_percent: u32,
    pub cur_image: String,
    pub handler: String,
}

/// Decodes one `progress_msg`. Its magic is not checked: SWUpdate 2022.12 leaves it 0.
pub(crate) fn parse_progress(buf: &[u8]) -> Result<Progress, String> {
    if buf.len() != PROGRESS_SIZE {
        return Err(format!(
            "a progress message of {} bytes, expected {PROGRESS_SIZE}",
            buf.len()
        ));
    }
    Ok(Progress {
        status: Recovery::from_code(get_u32(buf, prog::STATUS)),
        nsteps: get_u32(buf, prog::NSTEPS),
        cur_step: get_u32(buf, prog::CUR_STEP),
        cur_percent: get_u32(buf, prog::CUR_PERCENT),
        cur_image: get_cstr(buf, prog::CUR_IMAGE, 256),
        handler: get_cstr(buf, prog::HND_NAME, 64),
    })
}

/// A reply as the daemon writes it, for tests that play the daemon.
#[cfg(test)]
pub(crate) fn test_reply(kind: u32, current: u32, last_result: u32, desc: &str) -> Vec<u8> {
    let mut buf = header(MsgType::from_code(kind));
    put_u32(&mut buf, msg::STATUS_CURRENT, current);
    put_u32(&mut buf, msg::STATUS_LAST_RESULT, last_result);
    if kind == 2 {
        // A NACK's reason is in data.msg, where the status fields would be.
        buf[msg::DATA..msg::DATA + desc.len()].copy_from_slice(desc.as_bytes());
    } else {
        buf[msg::STATUS_DESC..msg::STATUS_DESC + desc.len()].copy_from_slice(desc.as_bytes());
    }
    buf
}

/// The message type and, for an install request, the image length of a message a client sent.
#[cfg(test)]
pub(crate) fn test_request(buf: &[u8]) -> (u32, u32) {
    (get_u32(buf, msg::TYPE), get_u32(buf, msg::REQ + req::LEN))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes and offsets as gcc gives them for the 2022.12 headers (`sizeof`, `offsetof`).
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn the_layout_is_the_c_compilers_on_64_bit_targets() {
        assert_eq!(MSG_SIZE, 3120);
        assert_eq!(req::SIZE, 1056);
        assert_eq!(msg::DATA, 8);
        assert_eq!(req::LEN, 16);
        assert_eq!(req::INFO, 24);
        assert_eq!(req::SOFTWARE_SET, 536);
        assert_eq!(req::RUNNING_MODE, 792);
        assert_eq!(req::DISABLE_STORE_SWU, 1048);
        // data.instmsg.len and data.instmsg.buf, from the start of ipc_message.
        assert_eq!(msg::DATA + req::SIZE, 1064);
        assert_eq!(msg::DATA + req::SIZE + 4, 1068);
        assert_eq!(msg::STATUS_ERROR, 16);
        assert_eq!(msg::STATUS_DESC, 20);
    }

    #[test]
    #[cfg(target_pointer_width = "32")]
    fn the_layout_is_the_c_compilers_on_armhf() {
        assert_eq!(MSG_SIZE, 3104);
        assert_eq!(req::SIZE, 1044);
        assert_eq!(msg::DATA, 8);
        assert_eq!(req::LEN, 12);
        assert_eq!(req::INFO, 16);
        assert_eq!(req::DISABLE_STORE_SWU, 1040);
        assert_eq!(msg::DATA + req::SIZE, 1052);
        assert_eq!(msg::DATA + req::SIZE + 4, 1056);
        assert_eq!(msg::STATUS_DESC, 20);
    }

    #[test]
    fn the_progress_message_is_the_same_on_every_target() {
        assert_eq!(PROGRESS_SIZE, 2416);
        assert_eq!(
            (prog::NSTEPS, prog::CUR_STEP, prog::CUR_PERCENT),
            (24, 28, 32)
        );
        assert_eq!((prog::CUR_IMAGE, prog::HND_NAME), (36, 292));
    }

    #[test]
    fn an_install_request_carries_the_magic_the_api_version_and_the_length() {
        let buf = install_request(0x0102_0304);
        assert_eq!(buf.len(), MSG_SIZE);
        assert_eq!(&buf[0..4], &[0x01, 0x20, 0x05, 0x14]);
        assert_eq!(get_u32(&buf, 4), 0, "REQ_INSTALL");
        assert_eq!(get_u32(&buf, msg::REQ), 1, "apiversion");
        assert_eq!(get_u32(&buf, msg::REQ + 4), 4, "SOURCE_LOCAL");
        assert_eq!(
            &buf[msg::REQ + req::LEN..msg::REQ + req::LEN + 4],
            &[4, 3, 2, 1]
        );
        assert!(buf[msg::REQ + req::INFO..].iter().all(|&b| b == 0));
        let status = status_request();
        assert_eq!((status.len(), get_u32(&status, 4)), (MSG_SIZE, 3));
    }

    #[test]
    fn a_status_answer_decodes_with_its_message() {
        let mut buf = header(MsgType::Ack);
        put_u32(&mut buf, msg::STATUS_CURRENT, 4);
        put_u32(&mut buf, msg::STATUS_LAST_RESULT, 3);
        put_u32(&mut buf, msg::STATUS_ERROR, 1);
        let text = b"ERROR : HASH mismatch";
        buf[msg::STATUS_DESC..msg::STATUS_DESC + text.len()].copy_from_slice(text);
        let reply = parse_reply(&buf).expect("a reply");
        assert_eq!(reply.kind, MsgType::Ack);
        assert_eq!(
            reply.status,
            Status {
                current: Recovery::Failure,
                last_result: Recovery::Success,
                error: 1,
                desc: "ERROR : HASH mismatch".to_owned(),
            }
        );
        assert!(parse_reply(&buf[..100]).is_err());
        buf[0] = 0;
        assert!(parse_reply(&buf).expect_err("bad magic").contains("magic"));
    }

    #[test]
    fn a_progress_message_decodes() {
        let mut buf = vec![0u8; PROGRESS_SIZE];
        put_u32(&mut buf, prog::STATUS, 8);
        put_u32(&mut buf, prog::NSTEPS, 2);
        put_u32(&mut buf, prog::CUR_STEP, 1);
        put_u32(&mut buf, prog::CUR_PERCENT, 40);
        buf[prog::CUR_IMAGE..prog::CUR_IMAGE + 7].copy_from_slice(b"payload");
        buf[prog::HND_NAME..prog::HND_NAME + 8].copy_from_slice(b"rawfile\0");
        let p = parse_progress(&buf).expect("progress");
        assert_eq!(
            p,
            Progress {
                status: Recovery::Progress,
                nsteps: 2,
                cur_step: 1,
                cur_percent: 40,
                cur_image: "payload".to_owned(),
                handler: "rawfile".to_owned(),
            }
        );
    }
}
