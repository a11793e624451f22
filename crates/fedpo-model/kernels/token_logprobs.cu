// The head's log-softmax + gather on an NVIDIA GPU, forward and backward, in f32:
// fedpo_model::ops::token_logprobs' CUDA half. The CPU kernels in token_logprobs.rs are the
// reference; the arithmetic here is theirs.
//
// Forward reads each [vocab] row of logits twice (its max, then the sum of exps) and writes
// one number per row. Backward writes d/dlogits = g * (onehot(t) - softmax(row)) straight
// from the logits, recovering the row's log-sum-exp from the forward result
// (lse = logit[t] - logp), so neither direction allocates a vocabulary-sized temporary.
#include <stdint.h>
#include <math.h>

// One block per row; blockDim.x is a multiple of 32, at most 1024.
__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Every thread gets the block's result. `shared` holds one float per warp.
__device__ float block_reduce(float v, float* shared, bool is_max) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = is_max ? warp_max(v) : warp_sum(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < warps ? shared[lane] : (is_max ? -INFINITY : 0.0f);
        w = is_max ? warp_max(w) : warp_sum(w);
        if (lane == 0) shared[0] = w;
    }
    __syncthreads();
    const float result = shared[0];
    __syncthreads();  // shared is reused by the next reduction
    return result;
}

// out[row] = logits[row, t] - logsumexp(logits[row, :]) with t = targets[row]. A target
// outside the vocabulary gives NaN (the host checks the targets before launching).
extern "C" __global__ void token_logprobs_f32(
    const float* __restrict__ logits,
    const uint32_t* __restrict__ targets,
    float* __restrict__ out,
    const uint32_t vocab
) {
    __shared__ float shared[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float max = -INFINITY;
    for (uint32_t j = threadIdx.x; j < vocab; j += blockDim.x) max = fmaxf(max, row[j]);
    max = block_reduce(max, shared, true);
    // An all -inf row has no finite shift; its sum of exps is then 0 and the log -inf.
    const float shift = isfinite(max) ? max : 0.0f;
    float sum = 0.0f;
    for (uint32_t j = threadIdx.x; j < vocab; j += blockDim.x) sum += expf(row[j] - shift);
    sum = block_reduce(sum, shared, false);
    if (threadIdx.x == 0) {
        const uint32_t t = targets[blockIdx.x];
        out[blockIdx.x] = t < vocab ? row[t] - (shift + logf(sum)) : NAN;
    }
}

// grad[row, j] = g * ((j == t) - exp(logits[row, j] - lse)), where lse = logits[row, t] -
// logp[row] and g = res_grad[rows + row]; res_grad is [logp (rows), g (rows)].
// Grid: x over rows, y over chunks of the row.
extern "C" __global__ void token_logprobs_grad_f32(
    const float* __restrict__ logits,
    const uint32_t* __restrict__ targets,
    const float* __restrict__ res_grad,
    float* __restrict__ grad,
    const uint32_t rows,
    const uint32_t vocab
) {
    const size_t r = blockIdx.x;
    const uint32_t t = targets[r];
    const float* row = logits + r * vocab;
    float* out = grad + r * vocab;
    const float lse = (t < vocab ? row[t] : NAN) - res_grad[r];
    const float g = res_grad[rows + r];
    for (uint32_t j = blockIdx.y * blockDim.x + threadIdx.x; j < vocab; j += gridDim.y * blockDim.x) {
        float v = -g * expf(row[j] - lse);
        if (j == t) v += g;
        out[j] = v;
    }
}
