// Small filesystem helpers. Durable writes follow one rule: write a temporary name in the same
// directory, fsync it, rename it into place, fsync the directory.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace gpusnap::fs {

std::string read_file(const std::filesystem::path& path);
// Reads a file that may be missing (returns false), e.g. /proc entries of a process that died.
bool try_read_file(const std::filesystem::path& path, std::string* out);
// Reads a file written by someone gpusnap does not trust (a manifest, a workload's handshake
// message): false with errno ELOOP for a symlink, EINVAL for anything but a regular file (a
// FIFO would block the reader), EFBIG past `max_bytes`.
bool try_read_regular_file(const std::filesystem::path& path, std::string* out, size_t max_bytes);
void write_file(const std::filesystem::path& path, const std::string& data);
// Atomic and durable: a temporary file of this writer's own beside `path` (mode 0600), fsync,
// rename, fsync of the folder. Nothing is left behind when it fails.
void write_file_durable(const std::filesystem::path& path, const std::string& data);
void fsync_path(const std::filesystem::path& path);
// fsync of every regular file under root, then of every directory, deepest first.
void fsync_tree(const std::filesystem::path& root);
// Makes a tree root-only whatever the umask was: directories 0700, files 0600. With `group`,
// that group may read it (0750, 0640, owned by the group). Symlinks are left alone. Throws.
void restrict_tree(const std::filesystem::path& root, std::optional<gid_t> group = {});
// Removes a tree, ignoring a missing path; never throws (used from destructors).
void remove_tree_noexcept(const std::filesystem::path& path) noexcept;
// A bearer token: the first line of `file`, trailing blanks dropped. Throws Error(kUsage) when
// the file is missing (its fix naming `flag`, the option that names it), readable by everyone
// (a token anyone can read protects nothing) or the token shorter than 16 characters.
std::string read_token_file(const std::filesystem::path& file, const std::string& flag);
// 16 random bytes as 32 hex characters.
std::string random_id();
// "1.2 GiB"-style sizes for people.
std::string human_bytes(uint64_t bytes);

}  // namespace gpusnap::fs
