//! Parsers for the few `/proc` lines attribution needs.
//!
//! Hand-written rather than procfs-core's: its `Stat::from_read` panics on a
//! malformed line (it slices around the parentheses unchecked), and its
//! `Status` rejects the whole file when any of some thirty fields is missing
//! or unparsable, where we need two lines and want the rest to degrade. Each
//! parser returns `None` (or an empty value) on garbage and never panics.

/// `USER_HZ`: the unit of the time fields in `/proc/<pid>/stat`. The kernel
/// converts its internal jiffies to this fixed rate for every userspace
/// interface, whatever `CONFIG_HZ` is, and it is 100 on every architecture
/// still supported. `sysconf(_SC_CLK_TCK)` would say the same, but asking
/// needs `unsafe` for a constant.
pub const USER_HZ: u64 = 100;

/// Longest command kept: a `cmdline` can run to megabytes (long argument
/// lists), and it travels with every sample.
pub const MAX_COMMAND_BYTES: usize = 4096;

/// The two fields of `/proc/<pid>/stat` attribution uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatFields {
    /// The kernel's short name (at most 15 bytes, any byte but NUL, so it may
    /// hold spaces and parentheses).
    pub comm: String,
    /// Clock ticks since boot; with the pid, it tells a reused pid apart.
    pub start_ticks: u64,
    /// The process group (`pgrp`): what a shell's job control or a
    /// launcher like torchrun gives the processes it starts together.
    pub process_group: u32,
}

/// Parses `pid (comm) state ppid ... starttime ...`. `comm` runs from the
/// first `(` to the *last* `)`, since only comm can contain one.
pub fn parse_stat(contents: &[u8]) -> Option<StatFields> {
    let open = contents.iter().position(|&b| b == b'(')?;
    let close = contents.iter().rposition(|&b| b == b')')?;
    let comm = contents.get(open + 1..close)?;
    let rest = std::str::from_utf8(contents.get(close + 1..)?).ok()?;
    // Fields after comm start at the third (state); pgrp is the 5th,
    // starttime the 22nd.
    let mut fields = rest.split_ascii_whitespace();
    let process_group = fields.nth(2)?.parse().ok()?;
    let start_ticks = fields.nth(16)?.parse().ok()?;
    Some(StatFields {
        comm: String::from_utf8_lossy(comm).into_owned(),
        start_ticks,
        process_group,
    })
}

/// What `/proc/<pid>/status` contributes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatusFields {
    /// Real uid: who started the process, even if it runs setuid.
    pub uid: Option<u32>,
    /// The pid in each pid namespace from the outermost (the reader's) in;
    /// empty on kernels before 4.1 or if the line is garbled.
    pub nspid: Vec<u32>,
}

pub fn parse_status(contents: &str) -> StatusFields {
    let mut fields = StatusFields::default();
    for line in contents.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        match key {
            "Uid" => {
                fields.uid = value
                    .split_ascii_whitespace()
                    .next()
                    .and_then(|v| v.parse().ok());
            }
            "NSpid" => {
                fields.nspid = value
                    .split_ascii_whitespace()
                    .map(str::parse)
                    .collect::<Result<_, _>>()
                    .unwrap_or_default();
            }
            _ => {}
        }
    }
    fields
}

/// Joins `cmdline`'s NUL-separated arguments with spaces. Trailing NULs go
/// (the terminator, and the padding of processes that rewrite their argv).
/// `None` when empty: kernel threads and zombies have no command line.
pub fn parse_cmdline(contents: &[u8]) -> Option<String> {
    let end = contents.iter().rposition(|&b| b != 0)? + 1;
    let args = contents.get(..end)?;
    let joined: Vec<u8> = args
        .iter()
        .map(|&b| if b == 0 { b' ' } else { b })
        .collect();
    let mut command = String::from_utf8_lossy(&joined).into_owned();
    truncate_at_char_boundary(&mut command, MAX_COMMAND_BYTES);
    Some(command)
}

/// Control characters (an argument like `python -c "a\nb"`, a `comm` with a
/// newline) become spaces: labels, logs and the collector, which refuses
/// names with control characters, all want one printable line.
pub fn printable(text: String) -> String {
    if text.chars().any(char::is_control) {
        text.chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect()
    } else {
        text
    }
}

fn truncate_at_char_boundary(s: &mut String, max: usize) {
    if s.len() > max {
        let cut = (0..=max)
            .rev()
            .find(|&i| s.is_char_boundary(i))
            .unwrap_or(0);
        s.truncate(cut);
    }
}

/// The value of `key` in an `environ` file (NUL-separated `KEY=value`
/// entries); `None` when absent, empty, or not a short printable word, as a
/// label value must be.
pub fn environ_value(contents: &[u8], key: &str) -> Option<String> {
    let value = contents.split(|&b| b == 0).find_map(|entry| {
        entry
            .strip_prefix(key.as_bytes())
            .and_then(|rest| rest.strip_prefix(b"="))
    })?;
    let value = std::str::from_utf8(value).ok()?;
    is_label_word(value).then(|| value.to_owned())
}

/// At most 128 bytes of letters, digits and `._-`: Slurm's account names
/// and nothing that could garble a label or a log line.
fn is_label_word(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 128
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Boot time in seconds since the Unix epoch, from `/proc/stat`'s `btime`.
pub fn parse_btime(contents: &str) -> Option<u64> {
    contents
        .lines()
        .find_map(|line| line.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// Unix epoch milliseconds of a process start; `None` on overflow, which
/// only garbage can cause.
pub fn start_time_ms(btime_s: u64, start_ticks: u64) -> Option<i64> {
    let boot_ms = btime_s.checked_mul(1000)?;
    let since_boot_ms = start_ticks.checked_mul(1000)? / USER_HZ;
    i64::try_from(boot_ms.checked_add(since_boot_ms)?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environ_values_are_whole_keys_and_label_words() {
        let env =
            b"PATH=/usr/bin\0SLURM_JOB_ACCOUNT_X=no\0SLURM_JOB_ACCOUNT=ml-vision\0HOME=/home/a\0";
        assert_eq!(
            environ_value(env, "SLURM_JOB_ACCOUNT").as_deref(),
            Some("ml-vision")
        );
        assert_eq!(environ_value(env, "SLURM_JOB"), None);
        for bad in [
            &b"SLURM_JOB_ACCOUNT=\0"[..],
            b"SLURM_JOB_ACCOUNT=a b\0",
            b"SLURM_JOB_ACCOUNT=\xff\0",
        ] {
            assert_eq!(environ_value(bad, "SLURM_JOB_ACCOUNT"), None, "{bad:?}");
        }
    }

    fn stat_line(comm: &str, start_ticks: u64) -> String {
        format!(
            "4242 ({comm}) S 1 4242 4242 0 -1 4194560 1500 0 3 0 120 30 0 0 20 0 12 0 {start_ticks} \
             123456789 20480 18446744073709551615 1 1 0 0 0 0 0 16781312 17642 0 0 0 17 3 0 0 0 0 0 \
             0 0 0 0 0 0 0\n"
        )
    }

    #[test]
    fn stat_plain() {
        assert_eq!(
            parse_stat(stat_line("python3", 987_654).as_bytes()),
            Some(StatFields {
                comm: "python3".into(),
                start_ticks: 987_654,
                process_group: 4242,
            })
        );
    }

    #[test]
    fn stat_comm_with_spaces_and_parentheses() {
        let parsed = parse_stat(stat_line("a) b (c) 9 9", 77).as_bytes());
        assert_eq!(
            parsed,
            Some(StatFields {
                comm: "a) b (c) 9 9".into(),
                start_ticks: 77,
                process_group: 4242,
            })
        );
    }

    #[test]
    fn stat_comm_with_newline_and_invalid_utf8() {
        let mut line = b"7 (x\n\xff) S".to_vec();
        line.extend_from_slice(b" 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5 0 0\n");
        let parsed = parse_stat(&line).map(|s| (s.comm, s.start_ticks));
        assert_eq!(parsed, Some(("x\n\u{fffd}".into(), 5)));
    }

    #[test]
    fn control_characters_become_spaces() {
        let command = parse_cmdline(b"python\0-c\0import os\nprint(1)\tx\0").unwrap_or_default();
        assert_eq!(printable(command), "python -c import os print(1) x");
        assert_eq!(printable("plain".into()), "plain");
    }

    #[test]
    fn stat_garbage_is_none() {
        for garbage in [
            &b""[..],
            b"(x) S 1",
            b"1 (x)",
            b"1 x) (y",
            b"1 (x) S 1 2 3",
            b"1 (x) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 notanumber 0",
            b"1 (x) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 -5 0",
            b"\xff\xfe\x00",
        ] {
            assert_eq!(parse_stat(garbage), None, "{garbage:?}");
        }
    }

    #[test]
    fn status_uid_and_nested_nspid() {
        let status = "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\n\
                      Pid:\t4242\nPPid:\t1\nUid:\t1000\t0\t0\t0\nGid:\t1000\t1000\t1000\t1000\n\
                      NStgid:\t4242\t310\t7\nNSpid:\t4242\t310\t7\nVmRSS:\t  1024 kB\n";
        assert_eq!(
            parse_status(status),
            StatusFields {
                uid: Some(1000),
                nspid: vec![4242, 310, 7],
            }
        );
    }

    #[test]
    fn status_garbage_degrades() {
        assert_eq!(parse_status(""), StatusFields::default());
        assert_eq!(parse_status("Uid:\n"), StatusFields::default());
        assert_eq!(
            parse_status("Uid:\t-1\t0\nNSpid:\t12\tx\n"),
            StatusFields::default()
        );
        assert_eq!(
            parse_status("no colon here\nUid: 0 0 0 0\nNSpid: 12\n"),
            StatusFields {
                uid: Some(0),
                nspid: vec![12],
            }
        );
    }

    #[test]
    fn cmdline_joins_arguments() {
        assert_eq!(
            parse_cmdline(b"python3\0train.py\0--lr=3e-4\0"),
            Some("python3 train.py --lr=3e-4".into())
        );
        // setproctitle pads with NULs and may omit the terminator.
        assert_eq!(
            parse_cmdline(b"worker: rank 3\0\0\0\0"),
            Some("worker: rank 3".into())
        );
        assert_eq!(
            parse_cmdline(b"no-terminator"),
            Some("no-terminator".into())
        );
    }

    #[test]
    fn empty_cmdline_is_none() {
        assert_eq!(parse_cmdline(b""), None);
        assert_eq!(parse_cmdline(b"\0\0"), None);
    }

    #[test]
    fn long_cmdline_is_truncated_on_a_char_boundary() {
        let mut arg = "é".repeat(MAX_COMMAND_BYTES);
        arg.push('\0');
        let command = parse_cmdline(arg.as_bytes()).unwrap_or_default();
        assert_eq!(command.len(), MAX_COMMAND_BYTES);
        assert!(command.chars().all(|c| c == 'é'));
    }

    #[test]
    fn btime_line() {
        let stat = "cpu  1 2 3 4\ncpu0 1 2 3 4\nintr 1 2\nctxt 99\nbtime 1700000000\nprocesses 5\n";
        assert_eq!(parse_btime(stat), Some(1_700_000_000));
        assert_eq!(parse_btime("cpu 1\n"), None);
        assert_eq!(parse_btime("btime soon\n"), None);
    }

    #[test]
    fn start_time_adds_ticks_to_boot() {
        assert_eq!(
            start_time_ms(1_700_000_000, 12_345),
            Some(1_700_000_123_450)
        );
        assert_eq!(start_time_ms(u64::MAX, 1), None);
        assert_eq!(start_time_ms(1, u64::MAX), None);
    }
}
