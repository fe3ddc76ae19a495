// GELU, tanh approximation (GPT-2's): y = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), and its
// derivative dy/dx = 0.5 (1 + tanh u) + 0.5 x sech^2(u) sqrt(2/pi) (1 + 3 * 0.044715 x^2). gelu.cu's
// forward and the MLP's backward (matmul.cu) both use these.
// Include it after common.cuh, which defines floatX.
#define GELU_SCALE 0.7978845608028654f  // sqrt(2 / pi)

// tanh(GELU_SCALE (x + 0.044715 x^3)). For bf16 storage by the special-function unit's tanh.approx (11 bits,
// more than bf16's 8; tanhf's software routine made the MLP's backward pass compute-bound); exact in fp32.
__device__ __forceinline__ float gelu_tanh(float x) {
    const float u = GELU_SCALE * (x + 0.044715f * x * x * x);
    if constexpr (sizeof(floatX) == 2) {
        float t;
        asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
        return t;
    } else {
        return tanhf(u);
    }
}

// GELU and its derivative at x, given th = gelu_tanh(x), which they share.
__device__ __forceinline__ float gelu(float x, float th) {
    return 0.5f * x * (1.0f + th);
}

__device__ __forceinline__ float gelu_grad(float x, float th) {
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
}
