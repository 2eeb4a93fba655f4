/* CRC32C, which the values' headers record (kvoffload/_crc32c.h, shared with the disk
 * tier's reads). */
#include "_pipelines.h"

#include "../../_crc32c.h"

uint32_t (*crc_update)(uint32_t, const unsigned char *, size_t) = crc32c_bytes;

void init_crc(void) { crc_update = crc32c_init(); }
