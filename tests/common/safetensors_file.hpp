// Test helper: a safetensors file's bytes, cut into its JSON header and data section to edit
// either (the checkpoint tests' corrupt files).
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

namespace halfstep_test {

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A safetensors file cut into its JSON header and its data section, to edit either.
struct File {
  std::string header, data;
};

inline File split(const std::string& bytes) {
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)])) << (8 * i);
  return {bytes.substr(8, static_cast<std::size_t>(n)), bytes.substr(8 + static_cast<std::size_t>(n))};
}

inline std::string join(const File& f) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((f.header.size() >> (8 * i)) & 0xFFu);
  return out + f.header + f.data;
}

inline void replace(std::string& text, const std::string& from, const std::string& to) {
  const std::size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  text.replace(at, from.size(), to);
}

// Where tensor `name`'s bytes begin in the data section, read from the header save_checkpoint wrote.
inline std::size_t begin_of(const File& f, const std::string& name) {
  const std::size_t entry = f.header.find("\"" + name + "\":{");
  REQUIRE(entry != std::string::npos);
  const std::string key = "\"data_offsets\":[";
  const std::size_t at = f.header.find(key, entry);
  REQUIRE(at != std::string::npos);
  return static_cast<std::size_t>(std::stoull(f.header.substr(at + key.size())));
}

// Overwrites element `i` of tensor `name` (of `T`) in a checkpoint's data section.
template <class T>
std::string with_element(const std::string& bytes, const std::string& name, std::size_t i, T value) {
  File f = split(bytes);
  std::memcpy(&f.data[begin_of(f, name) + i * sizeof(T)], &value, sizeof(T));
  return join(f);
}

}  // namespace halfstep_test
