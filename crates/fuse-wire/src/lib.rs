//! The FUSE wire protocol as rebound sees it, standing between kernel and driver.
//!
//! Owns: the ABI ([`abi`]), parsing requests from the kernel ([`request`]), checking
//! messages from the driver before they are forwarded ([`reply`]), decoding what a request
//! changes in the objects the kernel holds ([`change`]), and locating in any message the node
//! ids and file handles that a driver restart renumbers ([`ids`]), and which error replies
//! suggest a failing driver ([`suspect`]).
//! Must not: use `unsafe`, panic on any input, or do I/O. Everything here is pure functions on
//! byte slices, so it can be unit-tested and fuzzed without a mount.

pub mod abi;
pub mod change;
pub mod ids;
pub mod reply;
pub mod request;
pub mod suspect;

pub use abi::{InHeader, NotifyCode, Opcode, OutHeader};
pub use change::Change;
pub use ids::{IdField, IdFields};
pub use reply::{error_reply, fix_init_reply, DriverMessage, InitReply};
pub use request::{map_open_flags, mask_init_request, ReplyShape, Request};
pub use suspect::is_suspect_error;

/// Why a message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("message too short: need {need} bytes, got {got}")]
    Short { need: usize, got: usize },
    #[error("header says {header} bytes, message has {got}")]
    LengthMismatch { header: u32, got: usize },
    #[error("error value {0} out of range (-511..=0)")]
    ErrorOutOfRange(i32),
    #[error("reply to a request that takes no reply")]
    UnexpectedReply,
    #[error("body of {got} bytes where {want} are required")]
    BadBodyLength { want: usize, got: usize },
    #[error("body of {got} bytes exceeds the {max} allowed")]
    TooLong { max: usize, got: usize },
    #[error("node id 0 in a reply that creates a node")]
    ZeroNodeId,
    #[error("impossible attribute: {0}")]
    BadAttr(&'static str),
    #[error("unknown notification code {0}")]
    UnknownNotification(i32),
    #[error("bad INIT reply: {0}")]
    BadInit(&'static str),
}
