//! The user names and passwords the embedded broker accepts, from a file.

use std::collections::HashMap;

use crate::error::{Result, TransportError};

/// Reads a password file: one `user:password` per line; blank lines and `#` comments are
/// skipped. The password is everything after the first `:`.
pub fn read_password_file(path: &std::path::Path) -> Result<HashMap<String, String>> {
    let err = |reason: String| TransportError::Credentials(format!("{}: {reason}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let mut users = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((user, password)) = line.split_once(':') else {
            return Err(err(format!("line {}: expected `user:password`", n + 1)));
        };
        if user.is_empty() || password.is_empty() {
            return Err(err(format!("line {}: an empty user name or password", n + 1)));
        }
        if users.insert(user.to_string(), password.to_string()).is_some() {
            return Err(err(format!("line {}: user `{user}` is listed twice", n + 1)));
        }
    }
    Ok(users)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_files_name_the_line_they_cannot_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("passwords");
        std::fs::write(&path, "# fleet\npi-1:s3cret:with-colon\n\npi-2:other\n").unwrap();
        let users = read_password_file(&path).unwrap();
        assert_eq!(users["pi-1"], "s3cret:with-colon");
        assert_eq!(users.len(), 2);
        std::fs::write(&path, "pi-1:a\npi-1\n").unwrap();
        let e = read_password_file(&path).unwrap_err().to_string();
        assert!(e.contains("passwords: line 2: expected `user:password`"), "{e}");
        std::fs::write(&path, "pi-1:a\npi-1:b\n").unwrap();
        assert!(read_password_file(&path).unwrap_err().to_string().contains("listed twice"));
    }
}
