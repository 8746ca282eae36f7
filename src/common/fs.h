// Small filesystem helpers. Durable writes follow one rule: write a temporary name in the same
// directory, fsync it, rename it into place, fsync the directory.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace gpusnap::fs {

std::string read_file(const std::filesystem::path& path);
// Reads a file that may be missing (returns false), e.g. /proc entries of a process that died.
bool try_read_file(const std::filesystem::path& path, std::string* out);
void write_file(const std::filesystem::path& path, const std::string& data);
// Atomic and durable: tmp + fsync + rename + fsync(dir).
void write_file_durable(const std::filesystem::path& path, const std::string& data);
void fsync_path(const std::filesystem::path& path);
// fsync of every regular file under root, then of every directory, deepest first.
void fsync_tree(const std::filesystem::path& root);
// Removes a tree, ignoring a missing path; never throws (used from destructors).
void remove_tree_noexcept(const std::filesystem::path& path) noexcept;
// 16 random bytes as 32 hex characters.
std::string random_id();
// "1.2 GiB"-style sizes for people.
std::string human_bytes(uint64_t bytes);

}  // namespace gpusnap::fs
