/* The bounce ring's fill copy (offload_core/bounce.py, built by offload_core/streamcopy.py).
 *
 * A fill copies a chunk of pageable weights into a pinned buffer that the GPU's DMA reads next. An
 * ordinary store first reads each destination line into the cache (a read for ownership) and writes
 * it back later: with the source read and the DMA read that is four passes over DRAM per byte.
 * Non-temporal stores skip the read for ownership and the cache: three passes. glibc's memcpy uses
 * them only past a threshold sized from the last-level cache (158 MB on a 300 MB-L3 host), far above
 * the ring's 16 MiB chunks, so the ring asks for them itself.
 *
 * dst and src must not overlap (a ring buffer and the host masters never do). SSE2 only: every
 * x86-64 CPU has it, and a copy this size is bound by memory, not by the vector width.
 */
#include <emmintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

void oj_stream_copy(void *dst, const void *src, size_t n)
{
    unsigned char *d = (unsigned char *)dst;
    const unsigned char *s = (const unsigned char *)src;
    size_t head, body, i;

    if (n < 4096) {  /* too short to be worth the fence */
        memcpy(d, s, n);
        return;
    }
    head = (size_t)(-(uintptr_t)d) & 63;  /* up to the destination's next 64-byte line */
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    body = n & ~(size_t)63;
    for (i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    /* the streamed lines are globally visible before the caller says the buffer is filled */
    _mm_sfence();
    memcpy(d + body, s + body, n - body);
}
