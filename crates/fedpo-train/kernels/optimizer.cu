// Optimizer updates in place on an NVIDIA GPU, f32: the CUDA half of fedpo_train's
// in-place ops (src/inplace.rs, src/inplace_on_device.rs), whose CPU kernels are the
// reference. `clip` points at one f32 on the device, the step's clipping factor
// min(1, max_norm / norm), so that clipping needs no read of the norm on the host.
#include <stdint.h>
#include <math.h>

#define ELEMENTWISE for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)

// theta -= lr * clip * g
extern "C" __global__ void clipped_sgd_step_f32(
    float* __restrict__ theta, const float* __restrict__ g, const float* __restrict__ clip,
    const float lr, const uint32_t n
) {
    const float step = lr * clip[0];
    ELEMENTWISE { theta[i] -= step * g[i]; }
}

// m = beta m + (1 - beta) (clip g), or with `square`, (clip g)^2
extern "C" __global__ void clipped_moment_update_f32(
    float* __restrict__ m, const float* __restrict__ g, const float* __restrict__ clip,
    const float beta, const uint32_t square, const uint32_t n
) {
    const float scale = clip[0];
    ELEMENTWISE {
        const float x = scale * g[i];
        m[i] = beta * m[i] + (1.0f - beta) * (square ? x * x : x);
    }
}

// theta = theta (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2) + eps)
extern "C" __global__ void adam_apply_f32(
    float* __restrict__ theta, const float* __restrict__ m, const float* __restrict__ v,
    const float lr, const float weight_decay, const float bc1, const float bc2, const float eps,
    const uint32_t n
) {
    const float decay = 1.0f - lr * weight_decay;
    ELEMENTWISE { theta[i] = theta[i] * decay - lr * (m[i] / bc1) / (sqrtf(v[i] / bc2) + eps); }
}
