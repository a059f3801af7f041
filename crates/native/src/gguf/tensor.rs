//! Tensor infos and views of their data.

use std::fmt;

use crate::Error;
use crate::quant::{self, GgmlType};

/// At most this many dimensions (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// One tensor as the file describes it. Every `TensorInfo` a [`super::GgufFile`] hands out
/// has been checked: its type is supported, its rows are whole blocks, and its `n_bytes` at
/// `offset` lie inside the data section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml's `ne`: `dims[0]` is the fastest-varying (a row), as in the file. A matrix with
    /// `dims == [576, 1536]` is 1536 rows of 576 elements.
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    /// From the start of the data section, as in the file; a multiple of the alignment.
    pub offset: usize,
    pub n_bytes: usize,
}

impl TensorInfo {
    /// Elements per row (`dims[0]`; 1 for a tensor without dimensions).
    pub fn row_len(&self) -> usize {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Rows: the product of every dimension but the first. (The products saturate rather
    /// than overflow; for an info from a parsed file they are exact, parsing checked them.)
    pub fn n_rows(&self) -> usize {
        self.dims
            .iter()
            .skip(1)
            .fold(1, |n, &d| n.saturating_mul(d))
    }

    pub fn n_elements(&self) -> usize {
        self.dims.iter().fold(1, |n, &d| n.saturating_mul(d))
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.n_bytes.checked_div(self.n_rows()).unwrap_or(0)
    }
}

/// A tensor of a [`super::GgufFile`]: its info and its bytes in the file.
#[derive(Clone, Copy)]
pub struct Tensor<'a> {
    pub(super) info: &'a TensorInfo,
    pub(super) data: &'a [u8],
}

impl<'a> Tensor<'a> {
    pub fn info(&self) -> &'a TensorInfo {
        self.info
    }

    pub fn name(&self) -> &'a str {
        &self.info.name
    }

    pub fn ty(&self) -> GgmlType {
        self.info.ty
    }

    pub fn dims(&self) -> &'a [usize] {
        &self.info.dims
    }

    /// The tensor's bytes, exactly `info().n_bytes` of them.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    /// The bytes of row `row`, if there is such a row.
    pub fn row_data(&self, row: usize) -> Option<&'a [u8]> {
        let row_bytes = self.info.row_bytes();
        if row >= self.info.n_rows() {
            return None;
        }
        self.data.get(row * row_bytes..(row + 1) * row_bytes)
    }

    /// Dequantizes row `row` into `dst` (`row_len()` elements).
    pub fn dequantize_row(&self, row: usize, dst: &mut [f32]) -> Result<(), Error> {
        let src = self.row_data(row).ok_or_else(|| Error::RowOutOfRange {
            tensor: self.info.name.clone(),
            row,
            n_rows: self.info.n_rows(),
        })?;
        quant::dequantize_row(self.info.ty, src, dst)
    }

    /// Dequantizes the whole tensor into `dst` (`n_elements()` elements), rows in order.
    pub fn dequantize_into(&self, dst: &mut [f32]) -> Result<(), Error> {
        quant::dequantize_row(self.info.ty, self.data, dst)
    }

    /// The whole tensor as `f32`, rows in order.
    pub fn dequantize(&self) -> Result<Vec<f32>, Error> {
        let mut out = vec![0f32; self.info.n_elements()];
        self.dequantize_into(&mut out)?;
        Ok(out)
    }
}

impl fmt::Debug for Tensor<'_> {
    /// The info only: the data can be hundreds of megabytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor").field("info", self.info).finish()
    }
}
