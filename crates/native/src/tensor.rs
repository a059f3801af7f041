//! Weight matrices in their kernel formats, and the step's activation rows.

use crate::kernels::{BlockQ8, GROUP_ROWS, GroupScales, Kernels, QK, WeightFormat, group_scales};

/// A weight matrix of `rows` output features × `cols` inputs, row-major, each row in
/// `format` (ggml's `ne0` is `cols`: one row is one output feature's weights).
#[derive(Clone, Debug)]
pub struct Matrix {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: Vec<u8>,
}

impl Matrix {
    /// `data` must hold exactly `rows` rows of `cols` values in `format`; `cols` a multiple
    /// of 32 (every format's block).
    pub fn new(format: WeightFormat, rows: usize, cols: usize, data: Vec<u8>) -> Option<Matrix> {
        let row_bytes = format.row_bytes(cols);
        (cols.is_multiple_of(QK) && data.len() == rows * row_bytes).then_some(Matrix {
            format,
            rows,
            cols,
            row_bytes,
            data,
        })
    }

    /// An f32 matrix from its values.
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Option<Matrix> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Matrix::new(WeightFormat::F32, rows, cols, data)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Bytes of the weights (what a step reads).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The weights' bytes, every row in [`format`](Self::format), back to back.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    pub fn row(&self, o: usize) -> &[u8] {
        &self.data[o * self.row_bytes..(o + 1) * self.row_bytes]
    }

    /// Output rows `range` of the product: `out[r · n + (o - range.start)] = row o · x row r`
    /// with `n = range.len()`, for every activation row `r`. Each output is one kernel call on
    /// its own: the result is the same whatever the range, the row count or the thread.
    pub fn matmul_range(
        &self,
        k: &Kernels,
        x: &Activations,
        range: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        debug_assert_eq!(x.cols, self.cols);
        let n = range.len();
        let blocks = self.cols / QK;
        // Tiles of activation rows that stay in cache while every weight row of the range
        // meets them; each weight row is unpacked once per group of the tile's rows, and the
        // rows after the last whole group (a batch-1 step's one row) meet the weight rows a
        // few at a time (`Kernels::dot_rows`).
        const TILE: usize = 32;
        let w = &self.data[range.start * self.row_bytes..range.end * self.row_bytes];
        let mut r0 = 0;
        while r0 < x.rows {
            let r1 = (r0 + TILE).min(x.rows);
            let grouped = r0 + (r1 - r0) / GROUP_ROWS * GROUP_ROWS;
            if grouped > r0 {
                let (xf, xq) = (
                    &x.values[r0 * self.cols..grouped * self.cols],
                    &x.q8[r0 * blocks..grouped * blocks],
                );
                // The tile's whole groups (`r0` is a multiple of the group).
                let groups = &x.scales[r0 / GROUP_ROWS * blocks..grouped / GROUP_ROWS * blocks];
                let out = &mut out[r0 * n..grouped * n];
                k.dot_grid(self.format, w, n, xf, xq, groups, self.cols, out, n);
            }
            for r in grouped..r1 {
                let (xf, xq) = (x.row_f32(r), x.row_q8(r));
                k.dot_rows(
                    self.format,
                    w,
                    xf,
                    xq,
                    self.cols,
                    &mut out[r * n..(r + 1) * n],
                );
            }
            r0 = r1;
        }
    }

    /// The whole product, `out` being `x.rows() × self.rows()` (see
    /// [`matmul_range`](Self::matmul_range)).
    pub fn matmul(&self, k: &Kernels, x: &Activations, out: &mut [f32]) {
        self.matmul_range(k, x, 0..self.rows, out)
    }
}

/// The step's activation rows: f32, and their 8-bit quantization for quantized weights.
#[derive(Clone, Debug, Default)]
pub struct Activations {
    rows: usize,
    cols: usize,
    values: Vec<f32>,
    q8: Vec<BlockQ8>,
    /// The quantized rows' scales, a group of rows side by side (`kernels::group_scales`).
    scales: Vec<GroupScales>,
}

impl Activations {
    /// Takes `rows × cols` values (reusing the buffers) and quantizes them per row.
    pub fn set(&mut self, k: &Kernels, rows: usize, cols: usize, values: &[f32]) {
        self.set_on(k, rows, cols, values, None)
    }

    /// [`set`](Self::set), the rows quantized over `team`'s threads when there are enough
    /// of them to be worth waking it (each row on its own: the same blocks either way).
    pub fn set_on(
        &mut self,
        k: &Kernels,
        rows: usize,
        cols: usize,
        values: &[f32],
        team: Option<&crate::team::Team>,
    ) {
        debug_assert_eq!(values.len(), rows * cols);
        debug_assert_eq!(cols % QK, 0);
        self.rows = rows;
        self.cols = cols;
        self.values.clear();
        self.values.extend_from_slice(values);
        self.q8.resize(rows * cols / QK, BlockQ8::default());
        let b = cols / QK;
        if b == 0 {
            return;
        }
        let (values, q8) = (&self.values, &mut self.q8);
        let mut rows_q: Vec<&mut [BlockQ8]> = q8.chunks_mut(b).collect();
        let one =
            |r: usize, q: &mut &mut [BlockQ8]| k.quantize_q8(&values[r * cols..(r + 1) * cols], q);
        match team {
            Some(team) if rows >= 16 => team.for_each(&mut rows_q, one),
            _ => rows_q.iter_mut().enumerate().for_each(|(r, q)| one(r, q)),
        }
        group_scales(&self.q8, b, &mut self.scales);
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn row_f32(&self, r: usize) -> &[f32] {
        &self.values[r * self.cols..(r + 1) * self.cols]
    }

    pub fn row_q8(&self, r: usize) -> &[BlockQ8] {
        let b = self.cols / QK;
        &self.q8[r * b..(r + 1) * b]
    }
}

impl Matrix {
    /// Row `o` as f32 values (`out.len() == cols`).
    pub fn dequantize_row(&self, o: usize, out: &mut [f32]) {
        use crate::kernels::{Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES};
        let f16 = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
        let row = self.row(o);
        match self.format {
            WeightFormat::F32 => {
                for (v, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                    *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            WeightFormat::Q8_0 => {
                for (vs, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(Q8_0_BYTES)) {
                    let d = f16(b, 0);
                    for (v, &q) in vs.iter_mut().zip(&b[2..]) {
                        *v = d * f32::from(q as i8);
                    }
                }
            }
            WeightFormat::Q4_0 | WeightFormat::Q4_1 => {
                let (bytes, off) = if self.format == WeightFormat::Q4_0 {
                    (Q4_0_BYTES, 2)
                } else {
                    (Q4_1_BYTES, 4)
                };
                for (vs, b) in out.chunks_exact_mut(QK).zip(row.chunks_exact(bytes)) {
                    let d = f16(b, 0);
                    for j in 0..QK / 2 {
                        let (lo, hi) = (f32::from(b[off + j] & 0x0F), f32::from(b[off + j] >> 4));
                        if self.format == WeightFormat::Q4_0 {
                            vs[j] = (lo - 8.0) * d;
                            vs[j + QK / 2] = (hi - 8.0) * d;
                        } else {
                            let m = f16(b, 2);
                            vs[j] = lo * d + m;
                            vs[j + QK / 2] = hi * d + m;
                        }
                    }
                }
            }
        }
    }
}
