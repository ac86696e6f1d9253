// Byte sizes written by people: config files, environment variables, Python
// arguments all go through parse_bytes so "5GB" means one thing everywhere.
#pragma once

#include <cstddef>
#include <string_view>

namespace tidal {

// Parses "123", "64MiB", "5GB", "1.5 GiB", "512k".
//   SI suffixes are powers of 1000:  KB MB GB TB (also K M G T, case-insensitive)
//   IEC suffixes are powers of 1024: KiB MiB GiB TiB
//   "B" alone or no suffix: bytes.
// Throws ValueError naming the text and the accepted forms on anything else
// (negative, empty, unknown suffix, fraction of a byte, overflow).
std::size_t parse_bytes(std::string_view text);

// Parses a bandwidth: a byte size followed by "/s" ("12GB/s", "500MiB/s").
// Returns bytes per second.
double parse_bandwidth(std::string_view text);

}  // namespace tidal
