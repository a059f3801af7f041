// tandem-native's GPU kernels: the Llama forward pass over tandem's paged KV, compiled at run
// time by NVRTC (gpu/device.rs), so the build needs no CUDA toolkit.
//
// Batch invariance, as on the CPU: every value a row gets is computed from that row's own
// inputs in an order fixed by the model's shape and the row's position, never by how many
// rows the step has, where they sit in it, or which thread block is free. Reductions run in
// a fixed order (a sequential loop per lane, then a fixed butterfly or tree), and the module
// is compiled with --fmad=false: no multiply and add is fused unless written as fmaf, so the
// compiler's choices cannot differ between launches of another shape.
//
// No headers: NVRTC's built-in ones differ between CUDA versions, and f16 conversions are
// one PTX instruction each.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define QK 32
#define FMT_F32 0
#define FMT_Q8_0 1
#define FMT_Q4_0 2
#define FMT_Q4_1 3
// Minus infinity without <math.h>'s INFINITY.
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even, as the CPU path's half::f16::from_f32.
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Value `j` (0..31) of block `b` of a weight row in format F, dequantized as ggml's
// reference does (and the CPU path's Matrix::dequantize_row): scale times quant, plus the
// minimum for Q4_1, each a separately rounded f32 operation.
template <int F>
__device__ __forceinline__ float wval(const u8* __restrict__ row, int b, int j) {
    if (F == FMT_F32) {
        return reinterpret_cast<const float*>(row)[b * QK + j];
    } else if (F == FMT_Q8_0) {
        const u8* blk = row + b * 34;
        float d = f16_to_f32(*reinterpret_cast<const u16*>(blk));
        return d * (float)(signed char)blk[2 + j];
    } else if (F == FMT_Q4_0) {
        const u8* blk = row + b * 18;
        float d = f16_to_f32(*reinterpret_cast<const u16*>(blk));
        int q = j < 16 ? (blk[2 + j] & 0x0F) : (blk[2 + j - 16] >> 4);
        return ((float)q - 8.0f) * d;
    } else {
        const u8* blk = row + b * 20;
        float d = f16_to_f32(*reinterpret_cast<const u16*>(blk));
        float m = f16_to_f32(*reinterpret_cast<const u16*>(blk + 2));
        int q = j < 16 ? (blk[4 + j] & 0x0F) : (blk[4 + j - 16] >> 4);
        return (float)q * d + m;
    }
}

// ---- matrix products --------------------------------------------------------------------

#define MM_WARPS 8
#define MM_ROWS 8

// Block b (32 values) of a weight row in format F, dequantized into w (see wval).
template <int F>
__device__ __forceinline__ void wblock(const u8* __restrict__ row, int b, float* w) {
    if (F == FMT_F32) {
        const float4* p = reinterpret_cast<const float4*>(row + b * 128);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 v = p[i];
            w[4 * i] = v.x;
            w[4 * i + 1] = v.y;
            w[4 * i + 2] = v.z;
            w[4 * i + 3] = v.w;
        }
    } else if (F == FMT_Q8_0) {
        const u16* blk = reinterpret_cast<const u16*>(row + b * 34);
        float d = f16_to_f32(blk[0]);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u16 q = blk[1 + i];
            w[2 * i] = d * (float)(signed char)(q & 0xff);
            w[2 * i + 1] = d * (float)(signed char)(q >> 8);
        }
    } else if (F == FMT_Q4_0) {
        const u16* blk = reinterpret_cast<const u16*>(row + b * 18);
        float d = f16_to_f32(blk[0]);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u16 q = blk[1 + i];
            w[2 * i] = ((float)(q & 0x0f) - 8.0f) * d;
            w[2 * i + 1] = ((float)((q >> 8) & 0x0f) - 8.0f) * d;
            w[2 * i + 16] = ((float)((q >> 4) & 0x0f) - 8.0f) * d;
            w[2 * i + 17] = ((float)(q >> 12) - 8.0f) * d;
        }
    } else {
        const u32* blk = reinterpret_cast<const u32*>(row + b * 20);
        u32 dm = blk[0];
        float d = f16_to_f32((u16)(dm & 0xffff)), m = f16_to_f32((u16)(dm >> 16));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 q = blk[1 + i];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                u32 byte = (q >> (8 * k)) & 0xff;
                w[4 * i + k] = (float)(byte & 0x0f) * d + m;
                w[4 * i + k + 16] = (float)(byte >> 4) * d + m;
            }
        }
    }
}

// Up to three products of the same activations (Q, K and V; gate and up), in one launch: the
// blocks of segment i compute y_i = (accumulate ? y_i : 0) + W_i . x + bias_i.
struct Seg {
    const u8* w;
    u64 row_bytes;
    int n_out;
    float* y;
    const float* bias;
};

// A warp owns MM_OUTS consecutive weight rows (one, in the kernels built below: with the
// activations in shared memory more saved nothing, and quadrupled the compile time) and up to
// MM_ROWS activation rows, which the block's MM_WARPS warps share. Lane L takes the 32-wide blocks L, L + 32,
// …, in order, each one's 32 products in element order into one fmaf chain per output; then
// a fixed butterfly sums the lanes and lane 0's sum goes out. Each output (r, o) is that one
// sequence of operations whatever else the warp, the block or the launch computes: the same
// bits for a row alone or in any batch, at any place in it. The activations go through
// shared memory 32 blocks (one per lane) at a time, each 32-wide block padded to 33 floats
// so the lanes read distinct banks.
#define XS_BLOCK 33
#define XS_ROW (32 * XS_BLOCK)

template <int F, int MM_OUTS>
__device__ void matmul(Seg s, int k_cols, const float* __restrict__ x, int n_rows,
                       int accumulate, int block) {
    __shared__ float xs[MM_ROWS * XS_ROW];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o0 = (block * MM_WARPS + warp) * MM_OUTS;
    int r0 = blockIdx.y * MM_ROWS;
    int no = max(0, min(MM_OUTS, s.n_out - o0));
    int nr = min(MM_ROWS, n_rows - r0);
    float acc[MM_OUTS][MM_ROWS];
#pragma unroll
    for (int j = 0; j < MM_OUTS; j++)
#pragma unroll
        for (int i = 0; i < MM_ROWS; i++) acc[j][i] = 0.0f;
    int blocks = k_cols / QK;
    for (int kc = 0; kc < blocks; kc += 32) {
        int nb = min(32, blocks - kc);
        __syncthreads();
        // Rows past the step's are zeros: every row is computed (branch-free), only the
        // step's go out.
        for (int idx = threadIdx.x; idx < MM_ROWS * nb * QK; idx += blockDim.x) {
            int r = idx / (nb * QK), rem = idx % (nb * QK);
            xs[r * XS_ROW + (rem / QK) * XS_BLOCK + rem % QK] =
                r < nr ? x[(u64)(r0 + r) * k_cols + (u64)kc * QK + rem] : 0.0f;
        }
        __syncthreads();
        if (lane < nb) {
            int b = kc + lane;
#pragma unroll
            for (int j = 0; j < MM_OUTS; j++) {
                // A warp's rows past the matrix compute on its last row, and are not written.
                float w[QK];
                wblock<F>(s.w + (u64)min(o0 + j, s.n_out - 1) * s.row_bytes, b, w);
#pragma unroll
                for (int i = 0; i < MM_ROWS; i++) {
                    const float* xp = xs + i * XS_ROW + lane * XS_BLOCK;
                    float a = acc[j][i];
#pragma unroll
                    for (int e = 0; e < QK; e++) a = fmaf(w[e], xp[e], a);
                    acc[j][i] = a;
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < MM_OUTS; j++)
#pragma unroll
        for (int i = 0; i < MM_ROWS; i++)
            if (j < no && i < nr)  // the same for the whole warp
#pragma unroll
                for (int off = 16; off > 0; off >>= 1)
                    acc[j][i] += __shfl_xor_sync(0xffffffffu, acc[j][i], off);
    // Lane 0's sums (the butterfly's order every output shares) go out.
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < MM_OUTS; j++) {
#pragma unroll
            for (int i = 0; i < MM_ROWS; i++) {
                if (j < no && i < nr) {
                    int o = o0 + j;
                    float v = acc[j][i];
                    if (s.bias) v = v + s.bias[o];
                    u64 at = (u64)(r0 + i) * s.n_out + o;
                    s.y[at] = accumulate ? s.y[at] + v : v;
                }
            }
        }
    }
}

template <int F, int OUTS>
__device__ void matmul3(Seg a, Seg b, Seg c, int nb_a, int nb_b, int k_cols,
                        const float* __restrict__ x, int n_rows, int accumulate) {
    int blk = blockIdx.x;
    if (blk < nb_a) {
        matmul<F, OUTS>(a, k_cols, x, n_rows, accumulate, blk);
    } else if (blk < nb_a + nb_b) {
        matmul<F, OUTS>(b, k_cols, x, n_rows, accumulate, blk - nb_a);
    } else {
        matmul<F, OUTS>(c, k_cols, x, n_rows, accumulate, blk - nb_a - nb_b);
    }
}

#define MATMUL(NAME, F, OUTS)                                                                  \
    extern "C" __global__ void NAME(Seg a, Seg b, Seg c, int nb_a, int nb_b, int k_cols,       \
                                    const float* x, int n_rows, int accumulate) {              \
        matmul3<F, OUTS>(a, b, c, nb_a, nb_b, k_cols, x, n_rows, accumulate);                  \
    }
MATMUL(matmul_f32, FMT_F32, 1)
MATMUL(matmul_q8_0, FMT_Q8_0, 1)
MATMUL(matmul_q4_0, FMT_Q4_0, 1)
MATMUL(matmul_q4_1, FMT_Q4_1, 1)

// ---- embedding --------------------------------------------------------------------------

// x[r] = row tokens[r] of the embedding matrix, dequantized. One block per row.
template <int F>
__device__ void embed(const u8* __restrict__ w, u64 row_bytes, int cols,
                      const u32* __restrict__ tokens, float* __restrict__ x) {
    int r = blockIdx.x;
    const u8* row = w + (u64)tokens[r] * row_bytes;
    for (int k = threadIdx.x; k < cols; k += blockDim.x) {
        x[(u64)r * cols + k] = wval<F>(row, k / QK, k % QK);
    }
}

#define EMBED(NAME, F)                                                                         \
    extern "C" __global__ void NAME(const u8* w, u64 row_bytes, int cols, const u32* tokens,   \
                                    float* x) {                                                \
        embed<F>(w, row_bytes, cols, tokens, x);                                               \
    }
EMBED(embed_f32, FMT_F32)
EMBED(embed_q8_0, FMT_Q8_0)
EMBED(embed_q4_0, FMT_Q4_0)
EMBED(embed_q4_1, FMT_Q4_1)

// ---- norms and elementwise --------------------------------------------------------------

#define NORM_THREADS 256

// out[r] = x[src] / rms(x[src]) * w, src = rows ? rows[r] : r. One block of NORM_THREADS per
// row: thread t sums the squares of elements t, t + 256, ... in f64, then a fixed tree.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ out, int d, float eps,
                                    const u32* __restrict__ rows) {
    __shared__ double part[NORM_THREADS];
    int r = blockIdx.x;
    u64 src = rows ? rows[r] : (u32)r;
    const float* xr = x + src * d;
    double sum = 0.0;
    for (int k = threadIdx.x; k < d; k += NORM_THREADS) {
        float v = xr[k];
        sum += (double)(v * v);
    }
    part[threadIdx.x] = sum;
    __syncthreads();
    for (int s = NORM_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    float mean = (float)(part[0] / (double)d);
    float scale = 1.0f / sqrtf(mean + eps);
    for (int k = threadIdx.x; k < d; k += NORM_THREADS) {
        out[(u64)r * d + k] = xr[k] * scale * w[k];
    }
}

// g = silu(g) * u over n values.
extern "C" __global__ void swiglu(float* __restrict__ g, const float* __restrict__ u, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = g[i];
        g[i] = v / (1.0f + expf(-v)) * u[i];
    }
}

// ---- RoPE and the KV store --------------------------------------------------------------

// Where row r's KV slot for layer l starts: its block (from the row's block table) and its
// slot in the block, `[layer][token][K then V][head][dim]` in f16.
__device__ __forceinline__ u8* kv_slot(u64 arena, u64 block_bytes, const u32* tables,
                                       u32 table_off, u32 pos, int bs, int l, int kv_token) {
    u32 block = tables[table_off + pos / bs];
    return reinterpret_cast<u8*>(arena) + (u64)block * block_bytes +
           (u64)(l * bs + (int)(pos % bs)) * kv_token;
}

// One block per row: Q and K rotated by the row's angles (cos, sin: `rope_dims / 2` each, the
// host's, as the CPU path computes them), then K and V stored in the arena as f16.
extern "C" __global__ void rope_store(float* __restrict__ q, float* __restrict__ k,
                                      const float* __restrict__ v, const float* __restrict__ cos,
                                      const float* __restrict__ sin, const u32* __restrict__ pos,
                                      const u32* __restrict__ table_off,
                                      const u32* __restrict__ tables, u64 arena, u64 block_bytes,
                                      int l, int bs, int n_head, int n_head_kv, int hd,
                                      int rope_dims, int neox) {
    int r = blockIdx.x;
    int half = rope_dims / 2;
    int qd = n_head * hd, kvd = n_head_kv * hd;
    const float* c = cos + (u64)r * half;
    const float* s = sin + (u64)r * half;
    float* qr = q + (u64)r * qd;
    float* kr = k + (u64)r * kvd;
    int pairs = (n_head + n_head_kv) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int head = p / half, i = p % half;
        float* x = head < n_head ? qr + head * hd : kr + (head - n_head) * hd;
        int a = neox ? i : 2 * i;
        int b = neox ? i + half : 2 * i + 1;
        float x0 = x[a], x1 = x[b];
        x[a] = x0 * c[i] - x1 * s[i];
        x[b] = x0 * s[i] + x1 * c[i];
    }
    __syncthreads();
    int kv_token = 2 * kvd * 2;
    u16* slot = reinterpret_cast<u16*>(
        kv_slot(arena, block_bytes, tables, table_off[r], pos[r], bs, l, kv_token));
    const float* vr = v + (u64)r * kvd;
    for (int e = threadIdx.x; e < kvd; e += blockDim.x) {
        slot[e] = f32_to_f16(kr[e]);
        slot[kvd + e] = f32_to_f16(vr[e]);
    }
}

// ---- attention --------------------------------------------------------------------------

#define ATT_THREADS 128
#define HD_MAX 256

__device__ __forceinline__ float block_max(float v, float* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = ATT_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    float m = red[0];
    __syncthreads();
    return m;
}

__device__ __forceinline__ float block_sum(float v, float* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = ATT_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    float m = red[0];
    __syncthreads();
    return m;
}

// Attention of every (row, query head) over the row's positions 0..=pos, K and V read back
// from the arena's f16 (the step's own tokens too), in two kernels.
//
// `attention` has a block of ATT_THREADS per (row, query head, split s): split s takes the
// positions s, s + ATT_SPLITS, s + 2·ATT_SPLITS, … (a fixed partition of positions, so a short
// decode step still spreads over ATT_SPLITS times more blocks), in tiles of ATT_THREADS of
// them, each tile folded into a running maximum, sum and output. Within a tile thread k
// scores the tile's position k; for the output the threads split into `parts` groups of `hd`
// dimensions (128 / hd of them; one when hd >= 128, each thread then taking dimensions d and
// d + 128), part p summing the tile's positions p, p + parts, … in order; the parts add up in
// part order at the end. The split's maximum, sum and unnormalized output go to `part`.
// `attention_combine` folds the splits in split order. Every grouping depends on the row's
// length and the model's shape only: the result is the same however the prompt was chunked
// or batched. Needs hd a multiple of 8 (16-byte K loads).
#define ATT_SPLITS 16

extern "C" __global__ void attention(const float* __restrict__ q, float* __restrict__ part,
                                     const u32* __restrict__ pos,
                                     const u32* __restrict__ table_off,
                                     const u32* __restrict__ tables, u64 arena, u64 block_bytes,
                                     int l, int bs, int n_head, int n_head_kv, int hd,
                                     float scale) {
    __shared__ float qs[HD_MAX];
    __shared__ float p[ATT_THREADS];
    __shared__ float red[ATT_THREADS];
    __shared__ u64 slot0[ATT_THREADS];
    __shared__ float part_acc[ATT_THREADS * (HD_MAX / ATT_THREADS)];
    int r = blockIdx.x, h = blockIdx.y, sp = blockIdx.z, tid = threadIdx.x;
    int group = n_head / n_head_kv, g = h / group;
    int qd = n_head * hd, kvd = n_head_kv * hd;
    int kv_token = 2 * kvd * 2;
    int len = (int)pos[r] + 1;
    int count = sp < len ? (len - sp + ATT_SPLITS - 1) / ATT_SPLITS : 0;
    u32 toff = table_off[r];
    for (int d = tid; d < hd; d += ATT_THREADS) qs[d] = q[(u64)r * qd + h * hd + d];
    int parts = hd >= ATT_THREADS ? 1 : ATT_THREADS / hd;
    int prt = tid / hd, dim = tid % hd;
    bool outputs = prt < parts;  // threads past parts * hd only score
    const int per = HD_MAX / ATT_THREADS;
    float acc[per];
#pragma unroll
    for (int i = 0; i < per; i++) acc[i] = 0.0f;
    float m = NEG_INF, lsum = 0.0f;
    for (int i0 = 0; i0 < count; i0 += ATT_THREADS) {
        int n = min(ATT_THREADS, count - i0);
        __syncthreads();
        float sc = NEG_INF;
        if (tid < n) {
            u32 t = (u32)(sp + ATT_SPLITS * (i0 + tid));
            u64 slot = (u64)kv_slot(arena, block_bytes, tables, toff, t, bs, l, kv_token);
            slot0[tid] = slot;
            const uint4* kk =
                reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(slot) + g * hd);
            float dot = 0.0f;
            for (int d8 = 0; d8 < hd / 8; d8++) {
                uint4 v = kk[d8];
                u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    dot = fmaf(qs[d8 * 8 + 2 * e], f16_to_f32((u16)(w[e] & 0xffff)), dot);
                    dot = fmaf(qs[d8 * 8 + 2 * e + 1], f16_to_f32((u16)(w[e] >> 16)), dot);
                }
            }
            sc = dot * scale;
        }
        float m_new = fmaxf(m, block_max(sc, red));
        float e = tid < n ? expf(sc - m_new) : 0.0f;
        p[tid] = e;
        float tile_sum = block_sum(e, red);
        float alpha = expf(m - m_new);
        lsum = lsum * alpha + tile_sum;
        m = m_new;
        if (outputs) {
#pragma unroll
            for (int i = 0; i < per; i++) {
                int d = dim + i * ATT_THREADS;
                if (d < hd) {
                    float a = acc[i] * alpha;
#pragma unroll 8
                    for (int k = prt; k < n; k += parts) {
                        const u16* vv = reinterpret_cast<const u16*>(slot0[k]) + kvd + g * hd;
                        a = fmaf(p[k], f16_to_f32(vv[d]), a);
                    }
                    acc[i] = a;
                }
            }
        }
    }
    // The parts' sums, added in part order by the first part's threads.
    __syncthreads();
    if (outputs) {
#pragma unroll
        for (int i = 0; i < per; i++) part_acc[i * ATT_THREADS + tid] = acc[i];
    }
    __syncthreads();
    u64 at = (((u64)r * n_head + h) * ATT_SPLITS + sp) * (hd + 2);
    if (prt == 0) {
#pragma unroll
        for (int i = 0; i < per; i++) {
            int d = dim + i * ATT_THREADS;
            if (d < hd) {
                float a = part_acc[i * ATT_THREADS + dim];
                for (int pp = 1; pp < parts; pp++) a += part_acc[i * ATT_THREADS + pp * hd + dim];
                part[at + 2 + d] = a;
            }
        }
    }
    if (tid == 0) {
        part[at] = m;
        part[at + 1] = lsum;
    }
}

// One block per (row, query head): the splits' partial results folded in split order.
extern "C" __global__ void attention_combine(const float* __restrict__ part,
                                             float* __restrict__ out, int n_head, int hd) {
    int r = blockIdx.x, h = blockIdx.y;
    u64 base = ((u64)r * n_head + h) * ATT_SPLITS * (hd + 2);
    float mx = NEG_INF;
    for (int s = 0; s < ATT_SPLITS; s++) mx = fmaxf(mx, part[base + s * (hd + 2)]);
    float total = 0.0f;
    for (int s = 0; s < ATT_SPLITS; s++) {
        const float* ps = part + base + s * (hd + 2);
        total += ps[1] * expf(ps[0] - mx);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < ATT_SPLITS; s++) {
            const float* ps = part + base + s * (hd + 2);
            o += ps[2 + d] * expf(ps[0] - mx);
        }
        out[((u64)r * n_head + h) * hd + d] = o / total;
    }
}
