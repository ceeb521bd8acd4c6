//! Standard output for the commands, which often go into a pipe that closes early
//! (`flotilla plan --json | head`). `print!` panics when the reader has gone; [`out!`] and
//! [`outln!`] end the command quietly instead, with exit code 0 as the reader asked for no more
//! (ripgrep does the same). Any other write error ends it with a message and exit code 1.
//!
//! The demo does not use them: it must stop its agents and remove its directory first.

use std::io::{self, Write as _};

/// Writes `args` (and a newline when `newline`) to stdout, or ends the process as above.
pub fn write(args: std::fmt::Arguments<'_>, newline: bool) {
    let mut out = io::stdout().lock();
    let written = out.write_fmt(args).and_then(|()| {
        if newline {
            out.write_all(b"\n")
        } else {
            Ok(())
        }
    });
    if let Err(e) = written {
        exit_on(&e);
    }
}

/// Flushes stdout (a redraw without a newline at its end), or ends the process as above.
pub fn flush() {
    if let Err(e) = io::stdout().lock().flush() {
        exit_on(&e);
    }
}

/// Ends the process after a failed write to stdout: quietly for a closed pipe.
fn exit_on(e: &io::Error) -> ! {
    if e.kind() == io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("error: cannot write to standard output: {e}");
    std::process::exit(1);
}

/// `print!` that ends the command quietly when stdout is a closed pipe.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::out::write(format_args!($($arg)*), false)
    };
}

/// `println!` that ends the command quietly when stdout is a closed pipe.
macro_rules! outln {
    () => {
        $crate::cli::out::write(format_args!(""), true)
    };
    ($($arg:tt)*) => {
        $crate::cli::out::write(format_args!($($arg)*), true)
    };
}

pub(crate) use {out, outln};
