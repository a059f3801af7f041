//! `strftime` for the chat templates' `strftime_now(format)` (Llama 3.2/3.3 write "Today
//! Date: " + `strftime_now("%d %b %Y")`; Granite uses "%B %d, %Y"). transformers calls
//! `datetime.now().strftime(format)`, in the server's local time zone; with no time-zone
//! database at hand we format UTC, the time zone a server usually runs in.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// A UTC calendar time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Civil {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Monday
    weekday: u32,
    /// 1..=366
    yday: u32,
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

/// Days since 1970-01-01 → (year, month, day) (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn civil(t: SystemTime) -> Civil {
    let secs = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX / 2),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(0),
    };
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400) as u32;
    let (year, month, day) = civil_from_days(days);
    const CUMULATIVE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUMULATIVE[(month - 1) as usize] + day + u32::from(month > 2 && is_leap(year));
    Civil {
        year,
        month,
        day,
        hour: rem / 3600,
        minute: rem % 3600 / 60,
        second: rem % 60,
        // 1970-01-01 was a Thursday.
        weekday: (days + 3).rem_euclid(7) as u32,
        yday,
    }
}

/// Formats `t` (UTC) like C's `strftime`: `%a %A %b %h %B %c %d %e %D %F %H %I %j %m %M %p %S
/// %T %y %Y %Z %z %u %w %%`. Unknown directives are copied as they are (as glibc does).
pub(crate) fn strftime(format: &str, t: SystemTime) -> String {
    let c = civil(t);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(ch) = chars.next() {
        if ch != '%' {
            out.push(ch);
            continue;
        }
        let Some(spec) = chars.next() else {
            out.push('%');
            break;
        };
        let day_name = DAYS[c.weekday as usize];
        let month_name = MONTHS[(c.month - 1) as usize];
        let hour12 = match c.hour % 12 {
            0 => 12,
            h => h,
        };
        let _ = match spec {
            'a' => write!(out, "{}", &day_name[..3]),
            'A' => write!(out, "{day_name}"),
            'b' | 'h' => write!(out, "{}", &month_name[..3]),
            'B' => write!(out, "{month_name}"),
            'c' => write!(
                out,
                "{} {} {:>2} {:02}:{:02}:{:02} {}",
                &day_name[..3],
                &month_name[..3],
                c.day,
                c.hour,
                c.minute,
                c.second,
                c.year
            ),
            'd' => write!(out, "{:02}", c.day),
            'e' => write!(out, "{:>2}", c.day),
            'D' => write!(
                out,
                "{:02}/{:02}/{:02}",
                c.month,
                c.day,
                c.year.rem_euclid(100)
            ),
            'F' => write!(out, "{}-{:02}-{:02}", c.year, c.month, c.day),
            'H' => write!(out, "{:02}", c.hour),
            'I' => write!(out, "{hour12:02}"),
            'j' => write!(out, "{:03}", c.yday),
            'm' => write!(out, "{:02}", c.month),
            'M' => write!(out, "{:02}", c.minute),
            'p' => write!(out, "{}", if c.hour < 12 { "AM" } else { "PM" }),
            'S' => write!(out, "{:02}", c.second),
            'T' => write!(out, "{:02}:{:02}:{:02}", c.hour, c.minute, c.second),
            'y' => write!(out, "{:02}", c.year.rem_euclid(100)),
            'Y' => write!(out, "{}", c.year),
            'Z' => write!(out, "UTC"),
            'z' => write!(out, "+0000"),
            'u' => write!(out, "{}", c.weekday + 1),
            'w' => write!(out, "{}", (c.weekday + 1) % 7),
            '%' => write!(out, "%"),
            other => write!(out, "%{other}"),
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn formats_used_by_chat_templates() {
        // 2024-07-26 13:25:09 UTC, a Friday (Llama 3.1's default date).
        let t = at(1_722_000_309);
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime("%B %d, %Y", t), "July 26, 2024");
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-07-26 13:25:09");
        assert_eq!(
            strftime("%a %A %j %I%p %e %y %% %q", t),
            "Fri Friday 208 01PM 26 24 % %q"
        );
        assert_eq!(
            strftime("%F %T %Z%z", at(0)),
            "1970-01-01 00:00:00 UTC+0000"
        );
        // Leap day and the day after.
        assert_eq!(strftime("%F %j", at(951_782_400)), "2000-02-29 060");
        assert_eq!(
            strftime("%F %j %A", at(951_868_800)),
            "2000-03-01 061 Wednesday"
        );
        assert_eq!(strftime("trailing %", t), "trailing %");
    }
}
