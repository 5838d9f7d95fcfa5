//! Rows in PostgreSQL's binary `COPY` format, and sending them inside a
//! transaction. `COPY` inserts a partition's rows in multi-row batches (one
//! WAL record and one buffer lock for many rows) where `INSERT … SELECT
//! UNNEST(…)` inserts them one at a time, and binary fields need no parsing.
//!
//! Binary `COPY` does not convert types: every field must be written with
//! the width of its column (`BIGINT` as `i64`, `INTEGER` as `i32`,
//! `SMALLINT` as `i16`), in the order of the statement's column list.

use sqlx::{Postgres, Transaction};

use crate::StoreError;

/// "PGCOPY\n\xff\r\n\0", then 32-bit flags (no OIDs) and header-extension length.
const HEADER: &[u8] = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";
const TRAILER: i16 = -1;
const NULL: i32 = -1;

/// A buffer of rows with `columns` fields each.
#[derive(Debug)]
pub(super) struct BinaryRows {
    buf: Vec<u8>,
    columns: i16,
    rows: usize,
    /// Fields still owed by the row being written; checked in debug builds,
    /// where a miscount would otherwise surface as Postgres' "row field
    /// count is N, expected M".
    owed: i16,
}

impl BinaryRows {
    pub(super) fn new(columns: i16, expected_rows: usize) -> Self {
        // Two bytes of field count, four of length and at most eight of data
        // per field.
        let row_bytes = 2 + usize::try_from(columns).unwrap_or(0) * 12;
        let mut buf = Vec::with_capacity(HEADER.len() + expected_rows * row_bytes + 2);
        buf.extend_from_slice(HEADER);
        Self {
            buf,
            columns,
            rows: 0,
            owed: 0,
        }
    }

    /// Starts a row; its `columns` fields follow.
    pub(super) fn row(&mut self) -> &mut Self {
        debug_assert_eq!(self.owed, 0, "the previous row is missing fields");
        self.buf.extend_from_slice(&self.columns.to_be_bytes());
        self.rows += 1;
        self.owed = self.columns;
        self
    }

    pub(super) fn int8(&mut self, v: i64) -> &mut Self {
        self.field(&v.to_be_bytes())
    }

    pub(super) fn int4(&mut self, v: i32) -> &mut Self {
        self.field(&v.to_be_bytes())
    }

    pub(super) fn int2(&mut self, v: i16) -> &mut Self {
        self.field(&v.to_be_bytes())
    }

    pub(super) fn opt_int8(&mut self, v: Option<i64>) -> &mut Self {
        match v {
            Some(v) => self.int8(v),
            None => self.null(),
        }
    }

    pub(super) fn opt_int2(&mut self, v: Option<i16>) -> &mut Self {
        match v {
            Some(v) => self.int2(v),
            None => self.null(),
        }
    }

    fn null(&mut self) -> &mut Self {
        self.owe_one();
        self.buf.extend_from_slice(&NULL.to_be_bytes());
        self
    }

    fn field(&mut self, bytes: &[u8]) -> &mut Self {
        self.owe_one();
        // Fields here are at most eight bytes.
        let len = bytes.len() as i32;
        self.buf.extend_from_slice(&len.to_be_bytes());
        self.buf.extend_from_slice(bytes);
        self
    }

    fn owe_one(&mut self) {
        debug_assert!(self.owed > 0, "more fields than columns");
        self.owed -= 1;
    }

    pub(super) fn is_empty(&self) -> bool {
        self.rows == 0
    }

    fn into_bytes(mut self) -> Vec<u8> {
        debug_assert_eq!(self.owed, 0, "the last row is missing fields");
        self.buf.extend_from_slice(&TRAILER.to_be_bytes());
        self.buf
    }
}

/// Sends `rows` with `statement` (`COPY t (…) FROM STDIN (FORMAT binary)`)
/// inside `tx`. `COPY` takes every row or fails; on an error it is
/// abandoned and the transaction with it.
pub(super) async fn copy_in(
    tx: &mut Transaction<'_, Postgres>,
    statement: &str,
    rows: BinaryRows,
) -> Result<(), StoreError> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut copy = tx.copy_in_raw(statement).await?;
    copy.send(rows.into_bytes()).await?;
    copy.finish().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_follow_the_binary_copy_layout() {
        let mut rows = BinaryRows::new(3, 1);
        rows.row().int8(-2).int4(7).opt_int2(None);
        let bytes = rows.into_bytes();
        let mut want = HEADER.to_vec();
        want.extend_from_slice(&[0, 3]);
        want.extend_from_slice(&[0, 0, 0, 8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe]);
        want.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 7]);
        want.extend_from_slice(&[0xff, 0xff, 0xff, 0xff]);
        want.extend_from_slice(&[0xff, 0xff]);
        assert_eq!(bytes, want);
        assert_eq!(HEADER.len(), 19, "signature, flags and extension length");
    }

    #[test]
    fn no_rows_is_empty() {
        assert!(BinaryRows::new(2, 0).is_empty());
    }
}
